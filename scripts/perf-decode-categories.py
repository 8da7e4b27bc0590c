#!/usr/bin/env python3
"""Where a decode step's time goes, from a `perf` profile, for bmoe-cli or llama.cpp's llama-bench.

  perf record -F 1999 -e cpu-clock --call-graph dwarf,16384 -o P.data -- bmoe-cli -m M -p Hello -n 64
  perf record -F 1999 -e cpu-clock --call-graph dwarf,16384 -o P.data -- \
      llama-bench -m M -p 0 -n 64 -t 2 --repack 0 -r 1
  perf script -i P.data -F comm,tid,time,ip,sym,dso > P.txt
  perf-decode-categories.py P.txt bmoe|llama [SKIP_S]

Restricts to the decode window (bmoe: from the calling thread's first sample inside
`Engine::step`, plus SKIP_S seconds to pass the prompt's step; llama: from the first graph
compute) and prints the share of samples per leaf category and per phase for each thread kind
(main = the thread driving the step, worker = pool threads), then one table (docs/benchmarks.md,
"Decode profile"): every sample of every thread in one of experts' kernels, dense projections,
router, attention, activation quantisation, thread hand-off / waits, other. A bmoe pool worker's
kernel sample takes the phase of the calling thread's nearest sample (within 4 ms); llama.cpp's
`mul_mat_id` is inlined into `ggml_graph_compute_thread` in a release build, so its kernel
samples without a `mul_mat` frame count as experts. A diagnostic, not a test: the categories
follow symbol names and break when they change.
"""
import re
import sys
from collections import Counter, defaultdict

path, engine = sys.argv[1], sys.argv[2]
samples = []
cur = None
for line in open(path, errors="replace"):
    if not line.strip():
        if cur:
            samples.append(cur)
        cur = None
        continue
    if not line.startswith("\t") and not line.startswith(" " * 8 + "\t") and re.match(r"^\s*\S.*\s\d+\s+[\d.]+:", line):
        m = re.match(r"^\s*(.*?)\s+(\d+)\s+([\d.]+):", line)
        cur = {"comm": m.group(1), "tid": int(m.group(2)), "t": float(m.group(3)), "st": []}
        continue
    if cur is not None:
        parts = line.strip().split(None, 1)
        sym = parts[1] if len(parts) > 1 else parts[0]
        cur["st"].append(sym)
if cur:
    samples.append(cur)


def bmoe_cat(st):
    s = " | ".join(st)
    leaf = st[0] if st else ""
    # leaf category
    if "pool::wait_for_generation" in s and "claim_and_run" not in s:
        lc = "pool: worker waits for next round"
    elif "wait_done" in s:
        lc = "pool: caller waits for stragglers"
    elif "q4_k::" in s and "Kernel" in s:
        lc = "kernel Q4_K"
    elif "q6_k::" in s and ("dot" in s) and "Kernel" in s:
        lc = "kernel Q6_K"
    elif "q8_k" in s and ("quantize" in s or "fill" in s) or "ActBuf::fill" in s or "prepare_rows" in s:
        lc = "activation quantisation"
    elif "fp32" in s and "Kernel" in s or "float_dot" in s:
        lc = "kernel F32"
    elif "Kernel" in s and "dot" in s:
        lc = "kernel other"
    elif "blocks::attend" in s:
        lc = "attention"
    elif "claim_and_run" in s or "pool::" in leaf:
        lc = "pool: claim/other"
    else:
        lc = "other"
    # phase: from the stack
    if "split_ffn" in s or "Model<A>::expert" in s or "experts_one_row" in s:
        ph = "experts"
    elif "attend_layer" in s or "blocks::attend" in s:
        ph = "attention"
    elif "qwen_attention" in s or "attention_sublayer" in s:
        ph = "dense proj (q,k,v,o) + norms"
    elif "Model<A>::route" in s or "router_logits" in s:
        ph = "router"
    elif "finish_layer" in s:
        ph = "finish_layer"
    elif "Model<A>::head" in s or "norm_head" in s:
        ph = "head"
    elif "Engine<C,F,B>::step" in s:
        ph = "step other"
    else:
        ph = "outside step"
    return lc, ph


def llama_cat(st):
    s = " | ".join(st)
    leaf = st[0] if st else ""
    if "ggml_barrier" in leaf or "libgomp" in leaf or "GOMP" in leaf or ("[kernel" in leaf and "libgomp" in s):
        lc = "barrier / omp wait"
    elif "vec_dot_q4_K" in leaf:
        lc = "kernel Q4_K"
    elif "vec_dot_q6_K" in leaf:
        lc = "kernel Q6_K"
    elif "quantize_row" in leaf or "from_float" in s:
        lc = "activation quantisation"
    elif "vec_dot_f32" in leaf or "sgemm" in s:
        lc = "kernel F32"
    elif "vec_dot" in leaf:
        lc = "kernel other"
    elif "flash_attn" in s or "soft_max" in s:
        lc = "attention"
    else:
        lc = "other"
    m = re.search(r"ggml_compute_forward_([a-z_0-9]+)", s)
    ph = m.group(1) if m else ("graph compute other" if "ggml_graph_compute" in s else "outside compute")
    return lc, ph


if engine == "bmoe":
    main = [x for x in samples if x["comm"].startswith("bmoe") and "compute" not in x["comm"]]
    steps = [x["t"] for x in main if any("Engine<C,F,B>::step" in f for f in x["st"])]
    # first decode step: skip 10% of the step span to drop the prefill + first step
    t0, t1 = min(steps), max(steps)
    t0 = t0 + float(sys.argv[3]) if len(sys.argv) > 3 else t0
    win = [x for x in samples if t0 <= x["t"] <= t1]
    cat = bmoe_cat
    kind = lambda x: "main" if (x["comm"].startswith("bmoe") and "compute" not in x["comm"]) else ("worker" if "compute" in x["comm"] else x["comm"])
else:
    comp = [x["t"] for x in samples if any("ggml_graph_compute" in f or "ggml_backend" in f for f in x["st"])]
    t0, t1 = min(comp), max(comp)
    t0 = t0 + float(sys.argv[3]) if len(sys.argv) > 3 else t0
    win = [x for x in samples if t0 <= x["t"] <= t1 and x["comm"].startswith("llama")]
    tids = Counter(x["tid"] for x in win)
    main_tid = min(tids)
    cat = llama_cat
    kind = lambda x: "main" if x["tid"] == main_tid else "worker"

print(f"window {t1 - t0:.3f} s, {len(win)} samples")
by = defaultdict(Counter)
for x in win:
    lc, ph = cat(x["st"])
    k = kind(x)
    by[("leaf", k)][lc] += 1
    by[("leaf", "all")][lc] += 1
    by[("phase", k)][ph] += 1
    by[("phase", "all")][ph] += 1
    by[("phase x leaf", k)][f"{ph} / {lc}"] += 1
for key in sorted(by):
    c = by[key]
    n = sum(c.values())
    print(f"\n== {key[0]} [{key[1]}] n={n}")
    for name, v in c.most_common(25):
        print(f"  {100 * v / n:5.1f}%  {name}")

# ---- one table: every sample of every thread in one category ----
import bisect
def table_cat_bmoe(x, main_sorted, main_times):
    lc, ph = bmoe_cat(x["st"])
    if lc.startswith("pool: worker waits") or lc.startswith("pool: caller waits"):
        return "thread hand-off / waits"
    if lc == "pool: claim/other":
        return "thread hand-off / waits"
    if lc == "activation quantisation":
        return "activation quantisation"
    if lc == "attention" or ph == "attention":
        return "attention"
    if kind(x) != "main" and lc.startswith("kernel"):
        i = bisect.bisect_left(main_times, x["t"])
        best = None
        for j in (i - 1, i):
            if 0 <= j < len(main_sorted):
                dt = abs(main_sorted[j]["t"] - x["t"])
                if best is None or dt < best[0]:
                    best = (dt, main_sorted[j])
        if best and best[0] < 0.004:
            ph = bmoe_cat(best[1]["st"])[1]
        else:
            ph = "unattributed"
    if lc.startswith("kernel"):
        return {"experts": "experts' kernels", "dense proj (q,k,v,o) + norms": "dense projections (q,k,v,o, head)",
                "head": "dense projections (q,k,v,o, head)", "router": "router", "attention": "attention"}.get(ph, "kernel, phase unattributed")
    return "other"

def table_cat_llama(x):
    lc, ph = llama_cat(x["st"])
    if lc == "barrier / omp wait":
        return "thread hand-off / waits"
    if lc == "activation quantisation":
        return "activation quantisation"
    if ph in ("flash_attn_ext", "soft_max") or lc == "attention":
        return "attention"
    if ph.startswith("mul_mat_id") or (lc.startswith("kernel") and "forward_mul_mat" not in " ".join(x["st"])):
        # ggml_compute_forward_mul_mat_id is inlined into ggml_graph_compute_thread in this
        # build (no frame of its own); the dense mul_mat keeps its frame.
        return "experts' kernels"
    if ph.startswith("mul_mat"):
        return "router" if lc == "kernel F32" else "dense projections (q,k,v,o, head)"
    return "other"

print("\n== TABLE (all threads)")
tab = Counter()
if engine == "bmoe":
    ms = sorted([x for x in win if kind(x) == "main"], key=lambda x: x["t"])
    mt = [x["t"] for x in ms]
    for x in win:
        tab[table_cat_bmoe(x, ms, mt)] += 1
else:
    for x in win:
        tab[table_cat_llama(x)] += 1
un = tab.pop("kernel, phase unattributed", 0)
if un:
    ks = ["experts' kernels", "dense projections (q,k,v,o, head)", "router"]
    tot = sum(tab[k] for k in ks)
    for k in ks:
        tab[k] += un * tab[k] / tot
    print(f"  ({un} worker kernel samples with no main-thread sample within 4 ms, spread over the kernel phases in proportion)")
n = sum(tab.values())
for k, v in tab.most_common():
    print(f"  {100 * v / n:5.1f}%  {k}")
nw = n - tab["thread hand-off / waits"]
print("  -- excluding waits:")
for k, v in tab.most_common():
    if k != "thread hand-off / waits":
        print(f"  {100 * v / nw:5.1f}%  {k}")
