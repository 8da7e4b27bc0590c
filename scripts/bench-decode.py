#!/usr/bin/env python3
"""Decode speed, side by side in one run: bmoe-cli (resident) against llama.cpp (through the
PyPI llama-cpp-python package) on the same GGUF file, at 1 and 2 threads.

  bench-decode.py MODEL [--bin target/release/bmoe-cli] [-n 64] [--threads 1,2] [--reps 3]
                  [--compare-bin OTHER/bmoe-cli]

Prints tok/s per engine and thread count (median of --reps runs, interleaved so drift hits
both engines alike) and the ratio bmoe/llama.cpp. Greedy decoding, KV f32 for llama.cpp.
With --compare-bin, two bmoe builds instead of bmoe and llama.cpp (e.g. before and after a
change): median and best tok/s of each, the ratio of medians and the spread of the pairs'
ratios.
"""
import argparse
import re
import statistics
import subprocess
import sys
import time

PROMPT = "The expert cache keeps the experts the router asked for, and the streamer reads the rest"


def bmoe(bin_, model, n, t):
    out = subprocess.run([bin_, "-m", model, "-p", PROMPT, "-n", str(n), "-t", str(t)],
                         capture_output=True, text=True, check=True)
    m = re.search(r"generation: (\d+) tokens, ([0-9.]+) s/token(?: \(([0-9.]+) tok/s\))?", out.stderr)
    # The tok/s figure has more digits than the s/token one.
    return float(m.group(3)) if m.group(3) else 1.0 / float(m.group(2))


def llama(model, n, t):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_threads=t, n_threads_batch=t,
                          verbose=False, type_k=0, type_v=0, flash_attn=False)
    toks = llm.tokenize(PROMPT.encode())
    llm.eval(toks)
    t0 = time.perf_counter()
    last = toks[-1]
    for _ in range(n - 1):
        last = int(llm.scores[llm.n_tokens - 1].argmax())
        llm.eval([last])
    dt = time.perf_counter() - t0
    return (n - 1) / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--bin", default="target/release/bmoe-cli")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare-bin", help="a second bmoe-cli build, compared with --bin")
    a = ap.parse_args()
    if a.compare_bin:
        print(f"model {a.model}, {a.n} tokens; A = {a.bin}, B = {a.compare_bin}; {a.reps} interleaved runs")
        for t in [int(x) for x in a.threads.split(",")]:
            runs = [(bmoe(a.bin, a.model, a.n, t), bmoe(a.compare_bin, a.model, a.n, t)) for _ in range(a.reps)]
            xa, xb = [r[0] for r in runs], [r[1] for r in runs]
            ratios = [b / x for x, b in runs]
            print(f"threads {t}: A median {statistics.median(xa):.2f} best {max(xa):.2f} tok/s, "
                  f"B median {statistics.median(xb):.2f} best {max(xb):.2f} tok/s, "
                  f"B/A of medians {statistics.median(xb) / statistics.median(xa):.3f} "
                  f"(pairs {min(ratios):.2f}-{max(ratios):.2f})", flush=True)
        return
    try:
        import llama_cpp  # noqa: F401
        have_llama = True
    except ImportError:
        have_llama = False
        print("llama-cpp-python not installed: bmoe only", file=sys.stderr)
    print(f"model {a.model}, {a.n} tokens, median of {a.reps}")
    for t in [int(x) for x in a.threads.split(",")]:
        ours, ref = [], []
        for _ in range(a.reps):
            ours.append(bmoe(a.bin, a.model, a.n, t))
            if have_llama:
                ref.append(llama(a.model, a.n, t))
        o = statistics.median(ours)
        line = f"threads {t}: bmoe {o:.2f} tok/s"
        if ref:
            r = statistics.median(ref)
            line += f", llama.cpp {r:.2f} tok/s, ratio bmoe/llama.cpp {o / r:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
