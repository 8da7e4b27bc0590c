#!/usr/bin/env python3
"""A bounded load test of `bmoe-cli serve` on loopback (issue 18, docs/serving.md).

    python3 scripts/serve-load.py --bin target/release/bmoe-cli [--model M.gguf]
        [--requests 200] [--clients 8] [--queue 4] [--max-tokens 16]

Makes a tiny model (unless --model), starts the server on a free loopback port, and first
asks each client's prompt once, alone, for its reference answer (greedy). Then `--clients`
threads send `--requests` chat completions between them, each thread its own prompt. Every
request must be answered 200 or 503 (the queue full; not retried), every 200 must carry
exactly its own prompt's reference answer and token counts (nothing lost or mixed with
another's text), and the server's RSS must stay flat (sampled from /proc while it runs).
Prints the figures docs/serving.md records; exits 1 when a check fails.

    python3 scripts/serve-load.py --scaling --model M.gguf [--clients-list 1,2,4,8]
        [--per-client 3] [--max-tokens 64] [--server-args "--moe-stream --cache-mb 0"]

`--scaling` (`serve --parallel`, issue 35): one server with `--parallel` the largest client
count; for each count C, C threads each send `--per-client` streamed greedy chat completions
one after another, all starting together. Prints per C the aggregate generated tok/s (all
tokens over the wall time), the first-token latency p50/p99 (request sent to first content
chunk), the mean batch and the bytes read and routed per generated token of the shared steps
(`/metrics`), with each figure's ratio to C = 1 -- measured side by side in one run. Every
answer must equal its prompt's answer alone.
"""

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

PROMPTS = [
    "Tell me about rivers.",
    "What is a fox?",
    "Describe the sea at night in a few words.",
    "Name three colours.",
    "Why do birds sing in the morning?",
    "Write a line about mountains.",
    "How are bridges built?",
    "Say something kind.",
]


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def post(port, body, timeout=300):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    retry = r.getheader("Retry-After")
    c.close()
    return r.status, data, retry


def start_server(binary, model, args, tmp):
    err_path = os.path.join(tmp, "serve.stderr")
    err = open(err_path, "w")
    srv = subprocess.Popen([binary, "serve", "-m", model, "--port", "0"] + args,
                           stdout=subprocess.DEVNULL, stderr=err, cwd=tmp)
    for _ in range(1200):
        if srv.poll() is not None:
            sys.exit(f"serve exited {srv.returncode}: {open(err_path).read()}")
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", open(err_path).read())
        if m:
            port = int(m.group(1))
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return srv, port, err, err_path
        time.sleep(0.1)
    sys.exit("the server never became ready")


def streamed(port, body):
    """A streamed chat completion: (answer, completion tokens, seconds to the first content
    chunk, seconds in all)."""
    t0 = time.time()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions",
              body=json.dumps(dict(body, stream=True, stream_options={"include_usage": True})),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit(f"request failed: {r.status} {r.read()[:300]}")
    text, first, tokens = "", None, None
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        d = json.loads(line[6:])
        if d.get("usage"):
            tokens = d["usage"]["completion_tokens"]
        for ch in d.get("choices", []):
            piece = ch.get("delta", {}).get("content") or ""
            if piece and first is None:
                first = time.time() - t0
            text += piece
    c.close()
    return text, tokens, first if first is not None else time.time() - t0, time.time() - t0


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    out = {}
    for line in c.getresponse().read().decode().splitlines():
        if line and not line.startswith("#") and " " in line:
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    c.close()
    return out


def scaling(a):
    counts = [int(x) for x in a.clients_list.split(",")]
    if max(counts) > len(PROMPTS):
        sys.exit(f"--clients-list: at most {len(PROMPTS)} clients")
    tmp = tempfile.mkdtemp(prefix="bmoe-serve-scaling-")
    par = max(counts)
    args = ["--parallel", str(par), "-c", str(1024 * par)] + a.server_args.split()
    srv, port, err, err_path = start_server(a.bin, a.model, args, tmp)
    failures = []
    try:
        body = lambda p: {"messages": [{"role": "user", "content": p}], "max_tokens": a.max_tokens, "temperature": 0}
        # References alone (and a warm-up: the first requests fault the weights in).
        refs = {p: streamed(port, body(p))[0] for p in PROMPTS[:par]}
        rows = []
        for n in counts:
            before = metrics(port)
            lock = threading.Lock()
            results = []

            def client(i):
                for _ in range(a.per_client):
                    r = streamed(port, body(PROMPTS[i]))
                    with lock:
                        results.append((PROMPTS[i],) + r)
            threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
            t0 = time.time()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.time() - t0
            after = metrics(port)
            d = lambda k: after.get(k, 0) - before.get(k, 0)
            tokens = sum(r[2] for r in results)
            firsts = sorted(r[3] for r in results)
            q = lambda f: firsts[min(len(firsts) - 1, int(round(f * (len(firsts) - 1))))]
            gen = max(d("bmoe_batch_rows_total"), 1)
            row = dict(clients=n, requests=len(results), tokens=tokens, wall=wall, tps=tokens / wall,
                       p50=q(0.5), p99=q(0.99), batch=d("bmoe_batch_rows_total") / max(d("bmoe_batch_steps_total"), 1),
                       read=d("bmoe_batch_read_bytes_total") / gen, routed=d("bmoe_batch_routed_bytes_total") / gen,
                       routings=d("bmoe_batch_routings_total") / gen)
            rows.append(row)
            bad = sum(1 for r in results if r[1] != refs[r[0]])
            if bad:
                failures.append(f"{bad} answers of {n} clients differ from their prompt's answer alone")
        one = rows[0]
        print(f"model {os.path.basename(a.model)}, server {' '.join(args)}, max_tokens {a.max_tokens}, "
              f"{a.per_client} requests per client")
        print("| clients | requests | generated tok/s | x 1 client | first token p50 | p99 | p99 / 1 client's | mean batch | read MiB/token | routed MiB/token |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['clients']} | {r['requests']} | {r['tps']:.1f} | {r['tps'] / one['tps']:.2f} | "
                  f"{r['p50'] * 1000:.0f} ms | {r['p99'] * 1000:.0f} ms | {r['p99'] / one['p99']:.2f} | "
                  f"{r['batch']:.2f} | {r['read'] / 2**20:.2f} | {r['routed'] / 2**20:.2f} |")
        print(f"answers equal to the prompt's answer alone: {'all' if not failures else 'NOT all'}")
    finally:
        srv.terminate()
        srv.wait(timeout=60)
        err.close()
    for f in failures:
        print(f"FAIL: {f}")
    sys.exit(1 if failures else 0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release/bmoe-cli")
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--queue", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=None, help="16; 64 with --scaling")
    ap.add_argument("--scaling", action="store_true", help="--parallel: throughput and first-token latency by client count")
    ap.add_argument("--clients-list", default="1,2,4,8")
    ap.add_argument("--per-client", type=int, default=3)
    ap.add_argument("--server-args", default="", help="more serve flags (--scaling)")
    a = ap.parse_args()
    a.bin = os.path.abspath(a.bin)
    if a.model:
        a.model = os.path.abspath(a.model)
    if a.scaling:
        if not a.model:
            sys.exit("--scaling needs --model")
        a.max_tokens = a.max_tokens or 64
        return scaling(a)
    a.max_tokens = a.max_tokens or 16
    if a.clients > len(PROMPTS):
        sys.exit(f"--clients: at most {len(PROMPTS)}")
    tmp = tempfile.mkdtemp(prefix="bmoe-serve-load-")
    model = a.model
    if not model:
        model = os.path.join(tmp, "tiny.gguf")
        subprocess.run([a.bin, "gen", "--preset", "tiny", "--quiet", "-o", model], check=True)
    err_path = os.path.join(tmp, "serve.stderr")
    err = open(err_path, "w")
    srv = subprocess.Popen(
        [a.bin, "serve", "-m", model, "--port", "0", "-c", "2048", "--queue", str(a.queue)],
        stdout=subprocess.DEVNULL, stderr=err, cwd=tmp,
    )
    failures = []
    try:
        port = None
        for _ in range(600):
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", open(err_path).read())
            if m:
                port = int(m.group(1))
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            time.sleep(0.1)
        body = lambda p: {"messages": [{"role": "user", "content": p}], "max_tokens": a.max_tokens, "temperature": 0}
        refs = {}
        for p in PROMPTS[: a.clients]:
            st, data, _ = post(port, body(p))
            if st != 200:
                sys.exit(f"reference request failed: {st} {data[:200]}")
            d = json.loads(data)
            refs[p] = (d["choices"][0]["message"]["content"], d["usage"]["prompt_tokens"], d["usage"]["completion_tokens"])
        rss = [rss_mib(srv.pid)]
        results = []
        lock = threading.Lock()
        counter = iter(range(a.requests))

        def client(i):
            p = PROMPTS[i]
            while True:
                with lock:
                    n = next(counter, None)
                if n is None:
                    return
                t0 = time.time()
                retry = None
                try:
                    st, data, retry = post(port, body(p))
                except Exception as e:  # a lost request
                    st, data = -1, str(e).encode()
                dt = time.time() - t0
                with lock:
                    results.append((p, st, data, dt))
                if st == 503:
                    # The 503 is this request's answer; the client's next request honours
                    # Retry-After, as a well-behaved client does.
                    time.sleep(float(retry or 1))

        def sampler(stop):
            while not stop.is_set():
                rss.append(rss_mib(srv.pid))
                time.sleep(0.25)

        stop = threading.Event()
        s = threading.Thread(target=sampler, args=(stop,))
        s.start()
        t0 = time.time()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        stop.set()
        s.join()
        rss.append(rss_mib(srv.pid))
        ok = [r for r in results if r[1] == 200]
        busy = [r for r in results if r[1] == 503]
        other = [r for r in results if r[1] not in (200, 503)]
        mixed = 0
        for p, st, data, dt in ok:
            d = json.loads(data)
            got = (d["choices"][0]["message"]["content"], d["usage"]["prompt_tokens"], d["usage"]["completion_tokens"])
            if got != refs[p]:
                mixed += 1
                if mixed <= 3:
                    print(f"MISMATCH for {p!r}: got {got!r}, alone it was {refs[p]!r}")
        for p, st, data, dt in busy:
            e = json.loads(data)["error"]
            if "busy" not in e["message"]:
                failures.append(f"a 503 that is not 'busy': {e}")
        lat = sorted(r[3] for r in ok)
        q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] if lat else 0
        tokens = sum(json.loads(r[2])["usage"]["completion_tokens"] for r in ok)
        print(f"requests {len(results)}/{a.requests} answered: {len(ok)} x 200, {len(busy)} x 503, {len(other)} other")
        print(f"clients {a.clients}, queue {a.queue}, max_tokens {a.max_tokens}, wall {wall:.1f} s, "
              f"{len(ok) / wall:.1f} answered req/s, {tokens / wall:.0f} generated tok/s")
        print(f"latency of the 200s: p50 {q(0.5) * 1000:.0f} ms, p95 {q(0.95) * 1000:.0f} ms, max {q(1.0) * 1000:.0f} ms")
        warm = rss[0]
        print(f"server RSS: {warm:.1f} MiB after the reference requests, max {max(rss):.1f} MiB during, "
              f"{rss[-1]:.1f} MiB at the end ({len(rss)} samples)")
        print(f"answers equal to the prompt's answer alone: {len(ok) - mixed} of {len(ok)}")
        if len(results) != a.requests:
            failures.append(f"{a.requests - len(results)} requests lost")
        if other:
            failures.append(f"{len(other)} answers neither 200 nor 503: {[(r[1], r[2][:100]) for r in other[:3]]}")
        if mixed:
            failures.append(f"{mixed} answers differ from their prompt's answer alone")
        if rss[-1] > warm * 1.10 + 8:
            failures.append(f"RSS grew from {warm:.1f} to {rss[-1]:.1f} MiB")
    finally:
        srv.terminate()
        srv.wait(timeout=30)
        err.close()
    for f in failures:
        print(f"FAIL: {f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
