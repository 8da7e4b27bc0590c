#!/usr/bin/env python3
"""decide with a kept prefix against a cold one, side by side in one session.

  bench-decide.py MODEL [--bin target/release/bmoe-cli] [--reps 7] [--prefix-words 300]
                  [-- extra bmoe-cli flags, e.g. --moe-stream --cache-mb 64 --force-cache]

One `bmoe-cli --session --decide` process; per repetition a new suffix is asked twice against
the same long prefix: once restoring the kept prefix state (`reuse_prefix:true`) and once cold
(`reuse_prefix:false`, which prefills the whole render and keeps the prefix again), the order
alternating, so machine drift hits both alike. Prints the medians of `prefill_s`, the tokens
prefilled, `restore_s`, `store_s` and `prefix_state_mib`, the warm/cold ratio of prefill_s per
pair, and checks that every pair's `choice_logp` is bit-identical.
"""
import argparse
import json
import statistics
import subprocess
import sys

WORDS = ("the fox lived by the river and every morning it walked to the old oak to eat berries "
         "while the birds sang above the water and the wind moved the reeds ").split()
SUFFIXES = ["Did the fox eat berries?", "Was the river dry?", "Did the birds sing?",
            "Was there an oak?", "Did it rain?", "Was the fox hungry?", "Was it morning?",
            "Did the wind blow?", "Were there reeds?", "Did the fox swim?", "Was it cold?"]
CHOICES = ["yes", "no", "maybe"]


def main():
    argv = sys.argv[1:]
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--bin", default="target/release/bmoe-cli")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--prefix-words", type=int, default=300)
    a = ap.parse_args(argv)
    prefix = " ".join(WORDS[i % len(WORDS)] for i in range(a.prefix_words)) + ". "
    p = subprocess.Popen([a.bin, "-m", a.model, "--session", "--decide", "--chatml", "-c", "4096"]
                         + extra, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def reply(tags):
        while True:
            line = p.stdout.readline()
            if not line:
                raise SystemExit("the session ended")
            tag, _, body = line.rstrip("\n").partition(" ")
            if tag in tags:
                return tag, json.loads(body)

    def decide(i, suffix, reuse):
        p.stdin.write(json.dumps({"cmd": "decide", "id": i, "prefix": prefix, "suffix": suffix,
                                  "choices": CHOICES, "reuse_prefix": reuse}) + "\n")
        p.stdin.flush()
        tag, d = reply({"BMOE_DECIDE", "BMOE_ERROR"})
        if tag != "BMOE_DECIDE":
            raise SystemExit(f"decide failed: {d}")
        return d

    ready = reply({"BMOE_READY"})[1]
    print(f"model {a.model} {' '.join(extra)}: n_ctx {ready['n_ctx']}, load {ready['load_s']} s")
    decide(0, "Warm up.", True)  # keeps the prefix
    warm, cold, ratios = [], [], []
    for r in range(a.reps):
        suffix = SUFFIXES[r % len(SUFFIXES)]
        order = [True, False] if r % 2 == 0 else [False, True]
        got = {}
        for reuse in order:
            got[reuse] = decide(10 * r + int(reuse) + 1, suffix, reuse)
        w, c = got[True], got[False]
        assert w["n_reused"] > 0, w
        assert w["choice_logp"] == c["choice_logp"], (w, c)
        warm.append(w)
        cold.append(c)
        ratios.append(w["prefill_s"] / c["prefill_s"])
    p.stdin.write('{"cmd":"close"}\n')
    p.stdin.flush()
    p.wait()

    def med(rows, k):
        return statistics.median(x[k] for x in rows)

    print(f"{a.reps} pairs, medians; every pair's choice_logp bit-identical")
    print("         | n_tokens | n_reused | n_prefilled | prefill_s | prefill_read_mib | restore_s | store_s | prefix_state_mib")
    for name, rows in [("cold", cold), ("restored", warm)]:
        print(f"{name:8} | {med(rows, 'n_tokens'):8} | {med(rows, 'n_reused'):8} | "
              f"{med(rows, 'n_prefilled'):11} | {med(rows, 'prefill_s'):9.3f} | "
              f"{med(rows, 'prefill_read_mib'):16.1f} | {med(rows, 'restore_s'):9.4f} | "
              f"{med(rows, 'store_s'):7.4f} | {med(rows, 'prefix_state_mib'):.2f}")
    print(f"restored/cold prefill_s: median {statistics.median(ratios):.3f} "
          f"(pairs {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
