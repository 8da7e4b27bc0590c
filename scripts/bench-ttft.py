#!/usr/bin/env python3
"""Time to first token of a long prompt past RAM, side by side in one run (issue 20 item 2):

- bmoe streamed: bmoe-cli with no streaming flag inside the cgroup v1 memory limit (it streams by
  itself when the model does not fit), plus any --stream-flags variants;
- llama.cpp mmap: llama-bench -p N -n 0 --no-warmup --repack 0 -lm mmap inside the same limit;
- bmoe in RAM: bmoe-cli --no-moe-stream with no limit, the file read into the page cache first.

The page cache is dropped before every capped run; repetitions are interleaved. Needs root.

  bench-ttft.py MODEL [--prompt-file P.txt] --limit-gib 8 --llama-bench /work/llama-build/bin/llama-bench
                [--bin target/release/bmoe-cli] [-t 2] [--reps 2] [--stream-flags "--cache-mb 64"]...

Without --prompt-file the prompt is text made of random vocabulary pieces (seed 1), as diverse as
llama-bench's random token ids, grown to exactly N tokens with llama.cpp's tokenizer for the file
(bmoe's own count is checked). A prompt file must tokenize to N tokens for bmoe (checked against the CSV trailer's n_prompt;
N is llama-bench's -p). TTFT is the prompt's processing time: bmoe's `prefill_s` (the model load,
`load_s`, is printed apart), llama-bench's mean pp time. Prints a table of medians (ranges) and the
ratios of each run against bmoe in RAM and against llama.cpp, from the same repetition.
"""
import argparse
import json
import statistics
import subprocess
import tempfile

from benchlib import csv_summary, in_cgroup, set_limit


def bmoe(bin_, model, prompt, t, flags, capped):
    with tempfile.NamedTemporaryFile(suffix=".csv") as f:
        cmd = [bin_, "-m", model, "-f", prompt, "-n", "1", "-t", str(t), "-c", "1024",
               "--csv", f.name] + flags
        if capped:
            r = in_cgroup(cmd)
        else:
            r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"bmoe-cli {' '.join(flags)} failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
            return None
        kv = csv_summary(f.name)
    return {k: float(kv[k]) for k in ("n_prompt", "prefill_s", "load_s", "prefill_cpu_s",
                                      "prefill_read_mib", "prefill_io_s", "prefill_stall_s")}


def llama(lb, model, n, t):
    r = in_cgroup([lb, "-m", model, "-t", str(t), "-p", str(n), "-n", "0", "-r", "1", "--no-warmup",
                   "--repack", "0", "-lm", "mmap", "-o", "jsonl"])
    if r.returncode != 0:
        print(f"llama-bench failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
        return None
    rows = [json.loads(l) for l in r.stdout.splitlines() if l.strip().startswith("{")]
    return {"prefill_s": float(rows[-1]["avg_ns"]) / 1e9}


def random_prompt(model, n_tokens, seed=1):
    """Text of random printable vocabulary pieces that tokenizes (with BOS) to n_tokens."""
    import random
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    rng = random.Random(seed)
    text = ""
    while True:
        piece = llm.detokenize([rng.randrange(llm.n_vocab())])
        try:
            s = piece.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not (s.isprintable() and s.strip()) or "<" in s:
            continue
        if len(llm.tokenize((text + s).encode())) > n_tokens:
            break
        text += s
    n = len(llm.tokenize(text.encode()))
    while n < n_tokens:
        m = len(llm.tokenize((text + " a").encode()))
        if m > n_tokens:
            break
        text, n = text + " a", m
    f = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
    f.write(text)
    f.close()
    return f.name


def warm(model):
    subprocess.run(["sh", "-c", f"cat '{model}' > /dev/null"], check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompt-file")
    ap.add_argument("-p", type=int, default=512, help="prompt tokens (llama-bench -p; checked for bmoe)")
    ap.add_argument("--limit-gib", type=int, required=True)
    ap.add_argument("--llama-bench")
    ap.add_argument("--bin", default="target/release/bmoe-cli")
    ap.add_argument("--stream-flags", action="append", default=[],
                    help="an extra streamed bmoe variant (flags in one string); repeatable")
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    if not a.prompt_file:
        a.prompt_file = random_prompt(a.model, a.p)
    set_limit(a.limit_gib)
    runs = [("bmoe streamed (no flags)", lambda: bmoe(a.bin, a.model, a.prompt_file, a.t, [], True))]
    for fl in a.stream_flags:
        runs.append((f"bmoe streamed {fl}",
                     lambda fl=fl: bmoe(a.bin, a.model, a.prompt_file, a.t, fl.split(), True)))
    if a.llama_bench:
        runs.append(("llama.cpp mmap", lambda: llama(a.llama_bench, a.model, a.p, a.t)))

    def in_ram():
        warm(a.model)
        return bmoe(a.bin, a.model, a.prompt_file, a.t, ["--no-moe-stream"], False)

    runs.append(("bmoe in RAM (--no-moe-stream, no cap)", in_ram))
    res = {name: [] for name, _ in runs}
    print(f"{a.model}: pp{a.p}, cgroup limit {a.limit_gib} GiB for the streamed and llama.cpp runs, "
          f"{a.t} threads, {a.reps} reps interleaved", flush=True)
    for rep in range(a.reps):
        for name, fn in runs:
            out = fn()
            if out is not None and "n_prompt" in out and int(out["n_prompt"]) != a.p:
                print(f"{name}: bmoe tokenized the prompt to {int(out['n_prompt'])} tokens, not {a.p}")
            res[name].append(out)
            print(f"rep {rep + 1} {name}: {json.dumps(out)}", flush=True)
        print(f"rep {rep + 1} load average: {open('/proc/loadavg').read().split()[:3]}", flush=True)
    ram = "bmoe in RAM (--no-moe-stream, no cap)"
    print("\n| run | TTFT s median (range) | × bmoe in RAM (per rep) | × llama.cpp mmap (per rep) |")
    print("| --- | --- | --- | --- |")
    for name, outs in res.items():
        ttft = [o["prefill_s"] if o else float("nan") for o in outs]
        good = [x for x in ttft if x == x]
        med = statistics.median(good) if good else float("nan")
        rng = f"{min(good):.1f}-{max(good):.1f}" if good else "-"

        def ratios(base):
            if base not in res:
                return "-"
            r = []
            for o, b in zip(outs, res[base]):
                if o and b:
                    r.append(f"{o['prefill_s'] / b['prefill_s']:.2f}")
            return ", ".join(r) or "-"

        print(f"| {name} | {med:.1f} ({rng}) | {ratios(ram)} | {ratios('llama.cpp mmap')} |")


if __name__ == "__main__":
    main()
