#!/usr/bin/env python3
"""What constrained decoding costs per token (issue 35, item 2: the mask < 5 % of decode time).

    python3 scripts/bench-constrained.py --bin target/release/bmoe-cli --model M.gguf [--reps 5] [-n 64]

Starts `bmoe-cli serve` on the model and, interleaved in one run, asks the same raw prompt
greedily with no constraint, with `response_format: json_object` and with a JSON Schema, each
`--reps` times; reads each turn's decode rate from the `bmoe` telemetry (`tok_s`, the decode
tokens per second the engine measured: prefill excluded) and prints each constrained kind's
median rate against the unconstrained median, and the masks' own time (the server logs it per
constrained turn) as a share of a plain token's decode time: the direct figure, which the
run-to-run noise of the rates cannot hide. The first request of each kind (which builds the
grammar engine's token trie, once per model) is a warm-up and not counted.
"""

import argparse
import json
import re
import statistics
import subprocess
import tempfile
import time
import urllib.request

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 40},
    },
    "required": ["name", "items"],
    "additionalProperties": False,
}


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    err = tempfile.NamedTemporaryFile("w+", suffix=".stderr")
    srv = subprocess.Popen(
        [a.bin, "serve", "-m", a.model, "--port", "0", "-c", "2048", "-t", str(a.threads)],
        stdout=subprocess.DEVNULL, stderr=err,
    )
    try:
        port = None
        while port is None:
            m = re.search(r"127\.0\.0\.1:(\d+)", open(err.name).read())
            port = m and int(m.group(1))
            time.sleep(0.1)
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except Exception:
                time.sleep(0.2)
        kinds = {
            "plain": {},
            "json_object": {"response_format": {"type": "json_object"}},
            "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
        }
        rates = {k: [] for k in kinds}
        tokens = {k: [] for k in kinds}
        for rep in range(a.reps + 1):
            for k, extra in kinds.items():
                body = {"prompt": "Describe the river in JSON:", "max_tokens": a.n, "temperature": 0, **extra}
                r = post(port, "/v1/completions", body)
                if rep > 0:
                    rates[k].append(r["bmoe"]["tok_s"])
                    tokens[k].append(r["usage"]["completion_tokens"])
        log = open(err.name).read()
        masks = [(int(m.group(1)), float(m.group(2))) for m in re.finditer(r"grammar: (\d+) token masks in ([0-9.]+) ms", log)]
        base = statistics.median(rates["plain"])
        print(f"model {a.model}, -t {a.threads}, {a.reps} reps interleaved, decode tok/s from the bmoe telemetry")
        for k in kinds:
            med = statistics.median(rates[k])
            lo, hi = min(rates[k]), max(rates[k])
            print(f"{k:12} {med:8.2f} tok/s (range {lo:.2f}-{hi:.2f}, {statistics.median(tokens[k]):.0f} tokens)  x{med / base:.3f} of plain")
        # The masks' own time (the server's log line per constrained turn) against a plain
        # token's decode time: the direct figure, immune to the run-to-run noise above.
        counted = masks[2:]  # the two warm-up turns (json_object, json_schema) are not counted
        per_mask_ms = sum(ms for _, ms in counted) / max(1, sum(n for n, _ in counted))
        print(f"mask: {per_mask_ms:.3f} ms per token over {sum(n for n, _ in counted)} masks = "
              f"{100 * per_mask_ms / (1000 / base):.2f} % of a plain token's {1000 / base:.2f} ms")
    finally:
        srv.terminate()
        srv.wait(timeout=30)


if __name__ == "__main__":
    main()
