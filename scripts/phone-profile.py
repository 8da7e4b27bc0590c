#!/usr/bin/env python3
"""A phone's device profile whose compute side comes from our kernels' cycle counts, and the
tok/s it predicts for a model on real routing.

No ARM hardware here, so a phone's compute is priced, not measured: each weight tensor a decode
token multiplies (its routed experts, every layer's dense matrices, the output head) costs its
256-weight units x our kernel's llvm-mca cycles per unit for its format on each core model
(scripts/arm-mca.py's mca.json, decode), spread over the compute cores by their clocks (the
pool deals each product's row bands as tasks, so the cores' rates add up), and never less than
its bytes over the memory bandwidth (a decode product streams its weights from DRAM once:
whichever is slower bounds it). The sums become the simulator's per-byte rates
(`dense_mib_per_s`, `expert_mib_per_s`) and `head_ms`; the flash side and the eviction cost are
the base profile's (ufs40-phone: the UFS 4.0 datasheet rate, the origin phone's eviction cost).
Left out, and said in the profile: attention over the context, norms, routing, activation
quantization, sampling (small beside the weights at short context, and not priced).

  scripts/phone-profile.py --mca out/arm-mca/mca.json --model q30.gguf
      [--cores X3:1:3.19:neoverse-v1,A715-A710:4:2.8:neoverse-n2]
      [--mem-gbps 45] [--base sim/profiles/ufs40-phone.json]
      [--out sim/profiles/ufs40-phone-cycles.json]
      [--predict] [--traces ../shared/traces] [--tokens 400]

--predict then runs `bmoe-sim whatif` of the DeepSeek-V2-Lite capture (real routing, spread
onto the model's experts by --split-experts where it has more than 64) and of the synthetic
Qwen3-30B-shaped routing fitted to the origin phone's hit rates, in the origin's four
configurations, under this profile and under origin-12gb-phone (fitted to the origin's
measurements), and the change in tok/s when each input is a quarter better; it prints the
tables docs/benchmarks.md shows. Needs target/release/bmoe-cli and bmoe-sim (cargo build
--release).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
# Bytes of one 256-weight unit per format (ggml's block sizes).
UNIT_BYTES = {
    "F32": 1024, "F16": 512, "BF16": 512, "Q8_0": 272, "Q4_0": 144, "Q4_1": 160,
    "Q5_0": 176, "Q5_1": 192, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176,
    "Q6_K": 210, "IQ4_NL": 144, "IQ4_XS": 136, "MXFP4": 136,
}
# The origin's anchors (../shared/spec/features.md section 12: 12 GB phone, UFS 4.x, Qwen3-30B
# Q4_K_M): configuration -> (bmoe-sim flags, measured tok/s).
CONFIGS = [
    ("no cache, serial", ["--moe-stream", "--cache-mb", "0"], 1.7),
    ("cache 2000 MiB, serial", ["--moe-stream", "--cache-mb", "2000", "--force-cache"], 2.4),
    ("cache 4000 MiB, serial", ["--moe-stream", "--cache-mb", "4000", "--force-cache"], 4.0),
    ("cache 4000 MiB + overlap", ["--moe-stream", "--cache-mb", "4000", "--force-cache", "--overlap"], 5.2),
]


def die(msg):
    print(f"phone-profile: error: {msg}", file=sys.stderr)
    sys.exit(1)


def log(msg):
    print(f"phone-profile: {msg}", file=sys.stderr, flush=True)


def parse_cores(text):
    """'NAME:COUNT:GHZ:MCA_CPU,...' -> [(name, count, ghz, cpu)]."""
    cores = []
    for part in text.split(","):
        f = part.split(":")
        if len(f) != 4:
            die(f"--cores entry {part!r}: want NAME:COUNT:GHZ:CPU (CPU an llvm-mca model of mca.json)")
        try:
            n, ghz = int(f[1]), float(f[2])
        except ValueError:
            die(f"--cores entry {part!r}: COUNT and GHZ must be numbers")
        if n < 1 or not 0.1 <= ghz <= 10:
            die(f"--cores entry {part!r}: COUNT >= 1, GHZ in 0.1..10")
        cores.append((f[0], n, ghz, f[3]))
    return cores


def decode_cycles(mca, cores):
    """format -> {cpu: cycles per 256 weights} of our best level's decode kernel."""
    out = {}
    for row in mca["rows"]:
        if row["mode"] != "decode":
            continue
        best = row["ours"][mca["ours"]["best_level"]]
        out[row["format"]] = best["cycles_per_256"]
    for _, _, _, cpu in cores:
        if cpu not in mca["cpus"]:
            die(f"{cpu} is not priced in the mca.json (it has {', '.join(mca['cpus'])})")
    return out


def units_per_ns(cycles, fmt, cores):
    """256-weight units of `fmt` the cores compute per ns together."""
    if fmt not in cycles:
        die(f"the mca.json has no decode row for {fmt}")
    return sum(n * ghz / cycles[fmt][cpu] for _, n, ghz, cpu in cores)


def tensor_classes(info):
    """The tensors a decode token multiplies, per class: [(type, bytes per token)]."""
    k = info.get("hyperparameters", {})
    arch = info["architecture"]
    used = k.get(f"{arch}.expert_used_count")
    count = k.get(f"{arch}.expert_count")
    if not used or not count:
        die(f"{info['file']} is not a MoE file (no {arch}.expert_used_count / expert_count)")
    names = {t["name"] for t in info["tensors"]}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    cls = {"expert": [], "dense": [], "head": [], "vector": []}
    for t in info["tensors"]:
        name, ty, nbytes = t["name"], t["type"], t["bytes"]
        if name == head:
            cls["head"].append((ty, nbytes))
        elif not name.startswith("blk."):
            continue  # the embedding: one row looked up per token
        elif len(t["shape"]) == 1 or t["shape"][1] == 1:
            cls["vector"].append((ty, nbytes))  # norms, biases: resident bytes, no product
        elif "_exps." in name:
            cls["expert"].append((ty, nbytes * used / count))
        else:
            cls["dense"].append((ty, nbytes))
    return cls


def price(tensors, cycles, cores, mem_gbps):
    """ns a decode token spends on these tensors: per tensor the slower of its kernel cycles
    over the cores and its bytes over the memory bandwidth."""
    total = 0.0
    for ty, nbytes in tensors:
        if ty not in UNIT_BYTES:
            die(f"no unit size for {ty}")
        compute_ns = nbytes / UNIT_BYTES[ty] / units_per_ns(cycles, ty, cores)
        memory_ns = nbytes / mem_gbps  # GB/s = bytes per ns
        total += max(compute_ns, memory_ns)
    return total


def load_model(a):
    cli = ROOT / "target/release/bmoe-cli"
    if not cli.exists():
        die("target/release/bmoe-cli is missing: cargo build --release")
    p = subprocess.run([str(cli), "inspect", a.model, "--json"], capture_output=True, text=True)
    if p.returncode != 0:
        die(f"bmoe-cli inspect {a.model} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def make_profile(a, mca, info, cores, mem_gbps, name):
    """The profile of `cores` and `mem_gbps` (the base profile's flash and eviction)."""
    cycles = decode_cycles(mca, cores)
    cls = tensor_classes(info)
    ns = {c: price(cls[c], cycles, cores, mem_gbps) for c in ("expert", "dense", "head")}
    # Norms and biases are in each layer's dense bytes (the layout's dense_bytes): their bytes
    # count, their time is their read at the memory bandwidth.
    ns["dense"] += sum(b for _, b in cls["vector"]) / mem_gbps
    by = {c: sum(b for _, b in cls[c]) for c in cls}
    by["dense"] += by["vector"]
    base = json.loads(Path(a.base).read_text())
    prof = dict(base)
    prof["name"] = name
    core_text = ", ".join(f"{n}x {cname} at {ghz:g} GHz (llvm-mca {cpu})" for cname, n, ghz, cpu in cores)
    mix = {}
    for c in ("expert", "dense", "head"):
        for ty, b in cls[c]:
            mix[ty] = mix.get(ty, 0) + b
    bound = {c: ("memory" if by[c] / mem_gbps >= 0.999 * ns[c] else "compute") for c in ("expert", "dense", "head")}
    prof["description"] = (
        f"A phone whose compute is priced from our aarch64 kernels' llvm-mca cycles ({core_text}; "
        f"{mem_gbps:g} GB/s of DRAM bandwidth), with {Path(a.base).stem}'s flash and eviction cost. "
        f"Rates are those of {info['architecture']} {Path(a.model).name}'s decode: each product costs the slower of "
        f"its cycles over the cores and its bytes over the memory bandwidth (scripts/phone-profile.py)."
    )
    prof["sources"] = [
        f"compute cores: {core_text}; a Snapdragon 8 Gen 2 class 12 GB phone's prime and big cores (1x Cortex-X3 "
        f"priced on Neoverse-V1: both have four 128-bit vector pipes; 2x Cortex-A715 + 2x A710 on Neoverse-N2: two), "
        f"the engine's default compute threads there (README, On a phone); the origin phone's SoC is not named in "
        f"features.md (assumption)",
        f"memory: {mem_gbps:g} GB/s for the CPU cluster (assumption: LPDDR5X-8400 on a 64-bit bus peaks at 67 GB/s; "
        f"two thirds of it reached by CPU reads)",
        f"kernel cycles: scripts/arm-mca.py decode rows, our best level ({mca['ours']['best_level']}), commit "
        f"{mca['ours']['commit']}, {mca['llvm_mca']} (every load an L1 hit, every branch predicted)",
        "per token: " + ", ".join(f"{c} {by[c] / MIB:.1f} MiB in {ns[c] / 1e6:.2f} ms ({bound[c]}-bound)" for c in ("expert", "dense", "head"))
        + "; weight types " + ", ".join(f"{t} {b / MIB:.0f} MiB" for t, b in sorted(mix.items())),
        "not priced: attention over the context, norms' arithmetic, routing, activation quantization, sampling",
        f"flash, eviction (release_us_per_mib), mem_available_mib: from {Path(a.base).stem}",
    ]
    c = dict(base["compute"])
    c["expert_mib_per_s"] = round(by["expert"] / MIB / (ns["expert"] / 1e9), 1)
    c["dense_mib_per_s"] = round(by["dense"] / MIB / (ns["dense"] / 1e9), 1)
    c["head_ms"] = round(ns["head"] / 1e6, 3)
    c["layer_fixed_us"] = c["expert_fixed_us"] = c["loop_overhead_ms"] = 0.0
    prof["compute"] = c
    prof["threads"] = sum(n for _, n, _, _ in cores)
    return prof


def build(a):
    mca = json.loads(Path(a.mca).read_text())
    info = load_model(a)
    prof = make_profile(a, mca, info, parse_cores(a.cores), a.mem_gbps, Path(a.out).stem)
    Path(a.out).write_text(json.dumps(prof, indent=2) + "\n")
    c = prof["compute"]
    log(f"wrote {a.out}: expert {c['expert_mib_per_s']} MiB/s, dense {c['dense_mib_per_s']} MiB/s, head {c['head_ms']} ms")
    for line in prof["sources"]:
        log(f"  {line}")
    return mca, info


def whatif(sim, trace, layout, device, flags, split):
    cmd = [str(sim), "whatif", "--trace", str(trace), "--model", str(layout), "--device", str(device)] + flags
    if split:
        cmd.append("--split-experts")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        die(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    m = re.search(r"^generation: .*\(([0-9.]+) tok/s\)", p.stdout, re.M)
    if not m:
        die(f"no decode tok/s in the output of {' '.join(cmd)}:\n{p.stdout[-2000:]}")
    return float(m.group(1)), p.stdout


def predict(a, mca, info):
    sim = ROOT / "target/release/bmoe-sim"
    cli = ROOT / "target/release/bmoe-cli"
    if not sim.exists():
        die("target/release/bmoe-sim is missing: cargo build --release")
    tmp = Path(tempfile.mkdtemp(prefix="phone-profile-"))
    layout = tmp / "model.layout.csv"
    p = subprocess.run([str(cli), "inspect", a.model, "--layout-out", str(layout)], capture_output=True, text=True)
    if p.returncode != 0:
        die(f"bmoe-cli inspect --layout-out failed:\n{p.stderr[-2000:]}")
    # The DeepSeek-V2-Lite capture (64 experts, top-6) is the shipped routing nearest the
    # 30B-A3B shape: --split-experts spreads it over 128. (The Mixtral capture's 8 experts would
    # become groups of 16 of which a top-2 routing reaches at most 4 each: 32 of 128 experts per
    # layer, the invented spread would decide everything, so it is not used.)
    ds = Path(a.traces) / "deepseek-v2-lite-puffin.route.csv"
    if not ds.exists():
        die(f"{ds} is missing (--traces names the directory of the shipped traces)")
    synth = tmp / "synthetic-q30.route.csv"
    p = subprocess.run(
        [sys.executable, str(ROOT / "sim/scripts/synthetic-qwen3-30b-trace.py"), "1.5", str(synth), str(a.tokens)],
        capture_output=True, text=True)
    if p.returncode != 0:
        die(f"synthetic-qwen3-30b-trace.py failed:\n{p.stderr[-2000:]}")
    routings = [
        ("DeepSeek-V2-Lite capture (real, --split-experts)", ds, info["expert_count"] > 64),
        ("synthetic 30B routing (fitted to the origin's hit rates)", synth, False),
    ]
    profile = Path(a.out)
    print("tok/s, this profile / origin-12gb-phone (the origin's own fit):")
    print()
    print("| configuration | origin measured | " + " | ".join(r[0] for r in routings) + " |")
    print("| --- | ---: | " + " | ".join("---:" for _ in routings) + " |")
    for label, flags, measured in CONFIGS:
        row = [label, f"{measured}"]
        for _, t, split in routings:
            ours, out = whatif(sim, t, layout, profile, flags, split)
            origin, _ = whatif(sim, t, layout, "origin-12gb-phone", flags, split)
            hit = re.search(r"^moe-cache: ([0-9.]+)% hit", out, re.M)
            row.append(f"{ours:.2f} / {origin:.2f}" + (f" ({hit.group(1)} % hit)" if hit else ""))
        print("| " + " | ".join(row) + " |")
        log(f"{label}: " + " | ".join(row[2:]))
    print("| mmap baseline (not modelled: page-cache reclaim) | 2.0, unstable | - | - |")

    # Sensitivity: each input a quarter better, in the origin's best configuration.
    label, flags, _ = CONFIGS[-1]
    cores = parse_cores(a.cores)
    prof = json.loads(profile.read_text())

    def save(name, q):
        path = tmp / f"{name}.json"
        q = json.loads(json.dumps(q))
        q["name"] = name
        path.write_text(json.dumps(q))
        return path

    def edited(name, section, **scale):
        q = json.loads(json.dumps(prof))
        for k, f in scale.items():
            q[section][k] *= f
        return save(name, q)

    cases = [
        ("flash rate (lane and device) x1.25", edited("flash", "flash", lane_mib_per_s=1.25, device_mib_per_s=1.25), flags),
        ("DRAM bandwidth x1.25", save("dram", make_profile(a, mca, info, cores, a.mem_gbps * 1.25, "dram")), flags),
        ("core clocks x1.25 (or kernel cycles / 1.25)",
         save("clocks", make_profile(a, mca, info, [(n, c, g * 1.25, m) for n, c, g, m in cores], a.mem_gbps, "clocks")), flags),
        ("eviction cost / 1.25", edited("evict", "compute", release_us_per_mib=1 / 1.25), flags),
        ("read latency / 1.25", edited("latency", "flash", read_latency_us=1 / 1.25), flags),
        ("cache budget x1.25 (5000 MiB)", profile, [("5000" if f == "4000" else f) for f in flags]),
    ]
    print()
    print(f"Each input a quarter better ({label}):")
    print()
    print("| input | " + " | ".join(r[0] for r in routings) + " |")
    print("| --- | " + " | ".join("---:" for _ in routings) + " |")
    base = [whatif(sim, t, layout, profile, flags, split)[0] for _, t, split in routings]
    print("| (as above) | " + " | ".join(f"{b:.2f}" for b in base) + " |")
    for name, dev, fl in cases:
        cells = []
        for (_, t, split), b in zip(routings, base):
            tps, _ = whatif(sim, t, layout, dev, fl, split)
            cells.append(f"{tps:.2f} ({100 * (tps / b - 1):+.1f} %)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for _, t, split in routings:
        _, out = whatif(sim, t, layout, profile, flags, split)
        print()
        print("```")
        print("\n".join(l for l in out.splitlines()
                        if l.startswith(("whatif: mapping", "whatif: locality", "whatif: bytes", "whatif: time", "generation:", "moe-stream:", "moe-cache:"))))
        print("```")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--mca", required=True, help="mca.json of scripts/arm-mca.py")
    ap.add_argument("--model", required=True, help="the GGUF whose decode is priced (its header is read)")
    ap.add_argument("--cores", default="X3:1:3.19:neoverse-v1,A715-A710:4:2.8:neoverse-n2")
    ap.add_argument("--mem-gbps", type=float, default=45.0, help="DRAM bandwidth the compute cores reach, GB/s")
    ap.add_argument("--base", default=str(ROOT / "sim/profiles/ufs40-phone.json"))
    ap.add_argument("--out", default=str(ROOT / "sim/profiles/ufs40-phone-cycles.json"))
    ap.add_argument("--predict", action="store_true", help="run the whatif predictions (see above)")
    ap.add_argument("--traces", default=str(ROOT.parent / "shared/traces"))
    ap.add_argument("--tokens", type=int, default=400, help="decode tokens of the synthetic routing")
    a = ap.parse_args()
    if not 1 <= a.mem_gbps <= 1000:
        die("--mem-gbps must be in 1..1000")
    mca, info = build(a)
    if a.predict:
        predict(a, mca, info)


if __name__ == "__main__":
    main()
