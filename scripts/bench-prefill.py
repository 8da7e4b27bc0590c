#!/usr/bin/env python3
"""Prefill (ppN) and decode (tgN) speed, bmoe-cli against llama.cpp's llama-bench on the same
GGUF files, side by side in one run, interleaved (bmoe, llama.cpp, bmoe, ...) so machine load
and drift hit both alike.

  bench-prefill.py MODEL... [--bin target/release/bmoe-cli [--bin OTHER]] --llama-bench /work/llama-build/bin/llama-bench
                   [-t 2] [-p 128] [-n 64] [--reps 3] [--repack 0,1]

bmoe pp: a prompt that tokenizes to exactly -p tokens (found with llama.cpp's tokenizer for the
file, checked against bmoe's own `n_prompt`), generating one token; the rate is the CSV
trailer's n_prompt / prefill_s. bmoe tg: a one-word prompt, -n tokens; the rate is the
`generation:` line's tok/s. llama.cpp: `llama-bench -p P -n N` with each --repack setting (its
repacked CPU layouts on or off); "best" is the faster setting in that repetition.

Prints per model and test the median tok/s of each engine and the ratio bmoe / llama.cpp best:
the median of the repetitions' ratios and their spread (min-max).
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from benchlib import generation_tps, llama_bench_rates


def exact_prompt(model, n_tokens):
    """Text whose tokenization (with BOS, as both engines add it) is n_tokens long."""
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    words = ["the", "expert", "cache", "keeps", "routed", "experts", "and", "streams", "rest"]
    text = ""
    i = 0
    while True:
        cand = (text + " " + words[i % len(words)]).strip()
        if len(llm.tokenize(cand.encode())) > n_tokens:
            break
        text = cand
        i += 1
    n = len(llm.tokenize(text.encode()))
    # Pad with single characters up to the exact count.
    while n < n_tokens:
        cand = text + " a"
        m = len(llm.tokenize(cand.encode()))
        if m > n_tokens:
            break
        text, n = cand, m
    return text, n


def bmoe_pp(bin_, model, prompt, t):
    with tempfile.NamedTemporaryFile(suffix=".csv") as f:
        subprocess.run([bin_, "-m", model, "-p", prompt, "-n", "1", "-t", str(t), "--csv", f.name],
                       capture_output=True, text=True, check=True)
        trailer = [l for l in open(f.name) if l.startswith("# summary")][-1]
    kv = dict(x.split("=", 1) for x in trailer.split() if "=" in x)
    return int(kv["n_prompt"]), int(kv["n_prompt"]) / float(kv["prefill_s"])


def bmoe_tg(bin_, model, n, t):
    out = subprocess.run([bin_, "-m", model, "-p", "the", "-n", str(n), "-t", str(t)],
                         capture_output=True, text=True, check=True)
    return generation_tps(out.stderr)


def llama_bench(lb, model, p, n, t, repack):
    out = subprocess.run([lb, "-m", model, "-t", str(t), "-p", str(p), "-n", str(n), "-r", "1",
                          "--repack", repack, "-o", "jsonl"],
                         capture_output=True, text=True, check=True).stdout
    return llama_bench_rates(out)


def fmt(xs):
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--bin", action="append",
                    help="a bmoe-cli binary; repeat to compare builds in the same run "
                         "(each measured in every repetition; default target/release/bmoe-cli)")
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--repack", default="0,1")
    ap.add_argument("--tests", default="pp,tg", help="pp, tg, or both (pp,tg)")
    a = ap.parse_args()
    bins = a.bin or ["target/release/bmoe-cli"]
    tests = ["pp", "tg"] if a.tests == "both" else a.tests.split(",")
    if not tests or any(t not in ("pp", "tg") for t in tests):
        ap.error(f"--tests {a.tests!r}: expected pp, tg, pp,tg or both")
    load = os.getloadavg()
    print(f"threads {a.t}, pp{a.p} / tg{a.n}, {a.reps} interleaved repetitions, "
          f"load average at start {load[0]:.1f} on {os.cpu_count()} cores")
    for model in a.models:
        prompt, n_tok = exact_prompt(model, a.p)
        pp_b = {b: [] for b in bins}
        tg_b = {b: [] for b in bins}
        pp_r = {b: [] for b in bins}
        tg_r = {b: [] for b in bins}
        pp_l, tg_l = [], []
        for rep in range(a.reps):
            for b in bins:
                if "pp" in tests:
                    n, v = bmoe_pp(b, model, prompt, a.t)
                    if n != a.p:
                        print(f"  note: bmoe tokenized the prompt to {n} tokens, llama.cpp to {n_tok}")
                    pp_b[b].append(v)
                if "tg" in tests:
                    tg_b[b].append(bmoe_tg(b, model, a.n, a.t))
            r = llama_bench(a.llama_bench, model, a.p if "pp" in tests else 0,
                            a.n if "tg" in tests else 0, a.t, a.repack)
            if "pp" in tests:
                best = max(r[f"pp{a.p}"].values())
                pp_l.append(best)
                for b in bins:
                    pp_r[b].append(pp_b[b][-1] / best)
            if "tg" in tests:
                best = max(r[f"tg{a.n}"].values())
                tg_l.append(best)
                for b in bins:
                    tg_r[b].append(tg_b[b][-1] / best)
            detail = {k: {f"repack={rk}": round(rv, 2) for rk, rv in v.items()} for k, v in r.items()}
            mine = "; ".join(
                f"{b}: pp {round(pp_b[b][-1], 2) if pp_b[b] else '-'} tg {round(tg_b[b][-1], 2) if tg_b[b] else '-'}"
                for b in bins)
            print(f"  rep {rep + 1} (load {os.getloadavg()[0]:.1f}): {mine}; llama.cpp {detail}", flush=True)
        name = os.path.basename(model)
        for b in bins:
            tag = f" [{b}]" if len(bins) > 1 else ""
            if pp_b[b]:
                print(f"{name} pp{a.p}{tag}: bmoe {fmt(pp_b[b])} tok/s, llama.cpp best {fmt(pp_l)} tok/s, "
                      f"ratio {fmt(pp_r[b])}")
            if tg_b[b]:
                print(f"{name} tg{a.n}{tag}: bmoe {fmt(tg_b[b])} tok/s, llama.cpp best {fmt(tg_l)} tok/s, "
                      f"ratio {fmt(tg_r[b])}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
