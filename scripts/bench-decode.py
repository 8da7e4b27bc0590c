#!/usr/bin/env python3
"""Decode speed, side by side in one run: bmoe-cli (resident) against llama.cpp (through the
PyPI llama-cpp-python package) on the same GGUF file, at 1 and 2 threads.

  bench-decode.py MODEL [--bin target/release/bmoe-cli] [-n 64] [--threads 1,2] [--reps 3]

Prints tok/s per engine and thread count (median of --reps runs, interleaved so drift hits
both engines alike) and the ratio bmoe/llama.cpp. Greedy decoding, KV f32 for llama.cpp.
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
    m = re.search(r"generation: (\d+) tokens, ([0-9.]+) s/token", out.stderr)
    return 1.0 / float(m.group(2))


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
    a = ap.parse_args()
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
