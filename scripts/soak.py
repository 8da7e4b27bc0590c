#!/usr/bin/env python3
"""Soak: one `bmoe-cli --session` for many turns at an evicting cache budget, with transient
flash faults sprinkled over the reads, cancels mid-answer and decides between turns; the
process's RSS, open file descriptors and threads are sampled after turns 10, 100, 250, 500,
750 and the last, and must stay flat (issue 14, item 5).

  cargo build -p bmoe-engine             # a debug build: the cache's budget is asserted inside
  python3 scripts/soak.py                # 1000 turns (~5 min on 2 cores), table on stdout
  python3 scripts/soak.py --turns 200 --bin target/release/bmoe-cli

Exit 0 when flat: fds and threads equal at turn 10 and the last, RSS within --rss-tolerance
(5 %) — and every request answered, no fatal error, the process exiting 0 on `close`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["Tell me about the fox", "And the river?", "What did it eat", "Where did it sleep",
           "Was it happy"]


class Session:
    def __init__(self, argv, stderr):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=stderr, text=True, bufsize=1)

    def send(self, obj):
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def next(self):
        line = self.p.stdout.readline()
        if not line:
            sys.exit(f"soak: the session closed its stdout (exit {self.p.wait()})")
        tag, _, body = line.rstrip("\n").partition(" ")
        obj = json.loads(body)
        if tag == "BMOE_ERROR" and obj.get("fatal"):
            sys.exit(f"soak: fatal error: {obj}")
        return tag, obj

    def until(self, tag):
        lines = []
        while True:
            t, o = self.next()
            lines.append((t, o))
            if t == tag:
                return lines

    def sample(self):
        pid = self.p.pid
        with open(f"/proc/{pid}/status") as f:
            status = dict(l.split(":", 1) for l in f if ":" in l)
        kib = lambda k: int(status[k].split()[0])
        return {"rss_kib": kib("VmRSS"), "hwm_kib": kib("VmHWM"),
                "fds": len(os.listdir(f"/proc/{pid}/fd")),
                "threads": len(os.listdir(f"/proc/{pid}/task"))}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/debug/bmoe-cli"),
                    help="the bmoe-cli to soak (default: the debug build, whose cache asserts "
                         "its budget)")
    ap.add_argument("--turns", type=int, default=1000)
    ap.add_argument("--faults", default="seed=7,eio=0.15,short=0.15,spike=0.1,spike-ms=1",
                    help="--inject-faults spec (transient faults only: each is retried)")
    ap.add_argument("--cache-mb", default="4", help="the expert cache budget (tiny's experts "
                    "need ~12 MiB: 4 evicts every step)")
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--model", help="a model to use instead of a fresh `gen --preset tiny`")
    a = ap.parse_args()
    if not os.access(a.bin, os.X_OK):
        sys.exit(f"soak: {a.bin} is not an executable: build it first "
                 "(cargo build -p bmoe-engine)")
    tmp = tempfile.mkdtemp(prefix="bmoe-soak-")
    model = a.model or os.path.join(tmp, "tiny.gguf")
    if not a.model:
        subprocess.run([a.bin, "gen", "--preset", "tiny", "--quiet", "-o", model], check=True)
    err_path = os.path.join(tmp, "stderr.txt")
    with open(err_path, "w") as err:
        s = Session([a.bin, "-m", model, "--session", "--chatml", "--decide", "-c", "4096",
                     "-t", "2", "--moe-stream", "--cache-mb", a.cache_mb, "--force-cache",
                     "--overlap", "--inject-faults", a.faults], err)
        tag, ready = s.next()
        assert tag == "BMOE_READY", (tag, ready)
        marks = sorted({10, 100, 250, 500, 750, a.turns} & set(range(1, a.turns + 1)))
        samples, counts = {}, {"generate": 0, "cancelled": 0, "decide": 0, "tokens": 0}
        t0 = time.time()
        for turn in range(1, a.turns + 1):
            new_chat = turn % 5 == 1
            prompt = PROMPTS[turn % 5]
            if turn % 7 == 0:
                s.send({"cmd": "generate", "id": turn, "prompt": prompt, "n_predict": 3000,
                        "clear_kv": new_chat})
                s.until("BMOE_PROGRESS")
                s.send({"cmd": "cancel"})
                done = s.until("BMOE_DONE")[-1][1]
                if not done["cancelled"]:
                    sys.exit(f"soak: turn {turn}: cancel was not honoured: {done}")
                counts["cancelled"] += 1
            else:
                s.send({"cmd": "generate", "id": turn, "prompt": prompt, "n_predict": 8,
                        "clear_kv": new_chat})
                done = s.until("BMOE_DONE")[-1][1]
                if done["id"] != turn or done["tokens"] != 8:
                    sys.exit(f"soak: turn {turn}: unexpected answer {done}")
            counts["generate"] += 1
            counts["tokens"] += done["tokens"]
            if turn % 3 == 0:
                s.send({"cmd": "decide", "id": 10 * turn, "prefix": "A fox lived by a river. ",
                        "suffix": "Is it night?", "choices": ["yes", "no"]})
                d = s.until("BMOE_DECIDE")[-1][1]
                if d["best"] not in (0, 1):
                    sys.exit(f"soak: turn {turn}: decide gave no answer: {d}")
                counts["decide"] += 1
            if turn in marks:
                samples[turn] = s.sample()
                samples[turn]["s"] = time.time() - t0
                print(f"soak: turn {turn}: {samples[turn]}", file=sys.stderr, flush=True)
        s.send({"cmd": "close"})
        s.p.stdin.close()
        code = s.p.wait()
    with open(err_path) as f:
        stderr = f.read()
    notes = [l.strip() for l in stderr.splitlines() if "retries" in l or "injected" in l]
    print(f"| turn | RSS MiB | peak RSS MiB | fds | threads | elapsed s |")
    print(f"| --- | --- | --- | --- | --- | --- |")
    for t, v in samples.items():
        print(f"| {t} | {v['rss_kib'] / 1024:.1f} | {v['hwm_kib'] / 1024:.1f} | {v['fds']} | "
              f"{v['threads']} | {v['s']:.0f} |")
    print(f"\n{counts['generate']} generates ({counts['cancelled']} cancelled), "
          f"{counts['decide']} decides, {counts['tokens']} tokens; exit {code}; "
          "device: " + ("; ".join(notes) if notes else "no faults dealt, no retries"))
    first, last = samples[marks[0]], samples[marks[-1]]
    growth = last["rss_kib"] / first["rss_kib"] - 1
    problems = []
    if code != 0:
        problems.append(f"the session exited {code}")
    if a.faults and not any("injected" in n for n in notes):
        problems.append("--inject-faults dealt no fault: nothing was soaked with faults")
    if first["fds"] != last["fds"]:
        problems.append(f"open fds {first['fds']} -> {last['fds']}")
    if first["threads"] != last["threads"]:
        problems.append(f"threads {first['threads']} -> {last['threads']}")
    if abs(growth) > a.rss_tolerance:
        problems.append(f"RSS moved {100 * growth:+.1f} % from turn {marks[0]} to {marks[-1]}")
    if problems:
        sys.exit("soak: NOT flat: " + "; ".join(problems) + f" (stderr kept in {err_path})")
    print(f"soak: flat (RSS {100 * growth:+.2f} % from turn {marks[0]} to {marks[-1]})")


if __name__ == "__main__":
    main()
