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
        [--cap-mib 512]

`--scaling` (`serve --parallel`, issue 35): one server with `--parallel` the largest client
count; for each count C, C threads each send `--per-client` streamed greedy chat completions
one after another, all starting together, each request with a prompt of its own (so each
prefills it; the references alone are asked first). Prints per C the aggregate generated tok/s (all
tokens over the wall time), the first-token latency p50/p99 (request sent to first content
chunk), the mean batch and the bytes read and routed per generated token of the shared steps
(`/metrics`), with each figure's ratio to C = 1 -- measured side by side in one run. Every
answer must equal its prompt's answer alone. With `--sim target/release/bmoe-sim` the server
records its route trace (`--route-trace`, the `seq` column) and the script replays it in the
simulator with the server's streaming flags: the replay's counts of the shared decode steps
must equal the server's `bmoe_batch_*_total` (steps, rows, bytes read and routed, routings).

    python3 scripts/serve-load.py --soak 1800 [--model M.gguf] [--clients 4]

`--soak SECONDS` (issue 35): the server with `--parallel` the client count; each client, for
that long, sends a random mix (seeded) of plain and streamed chat completions, legacy
completions, and streamed requests it abandons after a few chunks. Checked: no 5xx but 503s by
design, every answer equal to its request's answer alone, RSS and open file descriptors flat
(sampled every 2 s).
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


def model_or_tiny(a, tmp):
    """`--model`, or a fresh tiny model in `tmp`."""
    if a.model:
        return a.model
    model = os.path.join(tmp, "tiny.gguf")
    subprocess.run([a.bin, "gen", "--preset", "tiny", "--quiet", "-o", model], check=True)
    return model


def start_server(binary, model, args, tmp, cap_mib=None):
    err_path = os.path.join(tmp, "serve.stderr")
    err = open(err_path, "w")
    cmd = [binary, "serve", "-m", model, "--port", "0"] + args
    if cap_mib:
        # Past RAM: the server in a cgroup v1 memory cap, the page cache dropped first.
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import benchlib
        why = benchlib.cgroup_problem()
        if why:
            sys.exit(f"--cap-mib: {why}")
        benchlib.set_limit_bytes(cap_mib << 20)
        benchlib.drop_caches()
        cmd = benchlib.cgroup_argv(cmd)
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=tmp)
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
    trace = os.path.join(tmp, "route.csv")
    if a.sim:
        args += ["--route-trace", trace]
    srv, port, err, err_path = start_server(a.bin, a.model, args, tmp, a.cap_mib)
    failures = []
    final = {}
    try:
        body = lambda p: {"messages": [{"role": "user", "content": p}], "max_tokens": a.max_tokens, "temperature": 0}
        # Every request its own prompt, differing from the first word on, so that each
        # prefills its prompt (no slot holds it): the first-token figures include that.
        ask = lambda n, i, k: f"Request {n}.{i}.{k}: {PROMPTS[i]}"
        # References alone (and a warm-up: the first requests fault the weights in).
        refs = {ask(n, i, k): streamed(port, body(ask(n, i, k)))[0]
                for n in counts for i in range(n) for k in range(a.per_client)}
        rows = []
        for n in counts:
            before = metrics(port)
            lock = threading.Lock()
            results = []

            def client(i):
                # Arrivals spread evenly over one lone request's time (clients that start
                # together and ask for equal lengths would otherwise stay in step, every
                # prompt arriving with all the others); --together keeps them together.
                if not a.together and rows:
                    time.sleep(i * rows[0]["each"] / n)
                for k in range(a.per_client):
                    p = ask(n, i, k)
                    r = streamed(port, body(p))
                    with lock:
                        results.append((p,) + r)
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
                       each=statistics.mean(r[4] for r in results),
                       p50=q(0.5), p99=q(0.99), batch=d("bmoe_batch_rows_total") / max(d("bmoe_batch_steps_total"), 1),
                       read=d("bmoe_batch_read_bytes_total") / gen, routed=d("bmoe_batch_routed_bytes_total") / gen,
                       routings=d("bmoe_batch_routings_total") / gen)
            rows.append(row)
            bad = sum(1 for r in results if r[1] != refs[r[0]])
            if bad:
                failures.append(f"{bad} answers of {n} clients differ from their prompt's answer alone")
        one = rows[0]
        print(f"model {os.path.basename(a.model)}, server {' '.join(args)}"
              + (f" in a {a.cap_mib} MiB memory cap" if a.cap_mib else "") + f", max_tokens {a.max_tokens}, "
              f"{a.per_client} requests per client, "
              + ("all starting together" if a.together else "client i starting i/C of a lone request's time in"))
        print("| clients | requests | generated tok/s | x 1 client | first token p50 | p99 | p99 / 1 client's | mean batch | read MiB/token | routed MiB/token |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['clients']} | {r['requests']} | {r['tps']:.1f} | {r['tps'] / one['tps']:.2f} | "
                  f"{r['p50'] * 1000:.0f} ms | {r['p99'] * 1000:.0f} ms | {r['p99'] / one['p99']:.2f} | "
                  f"{r['batch']:.2f} | {r['read'] / 2**20:.2f} | {r['routed'] / 2**20:.2f} |")
        print(f"answers equal to the prompt's answer alone: {'all' if not failures else 'NOT all'}")
        final = metrics(port)
    finally:
        srv.terminate()
        srv.wait(timeout=60)
        err.close()
    if a.sim and final:
        failures += replay_check(a, trace, final, err_path)
    for f in failures:
        print(f"FAIL: {f}")
    sys.exit(1 if failures else 0)


# The streaming flags serve and bmoe-sim share (a replay must run what the server ran).
SIM_FLAGS = {"--moe-stream": 0, "--cache-mb": 1, "--force-cache": 0, "--eviction": 1, "--overlap": 0,
             "--io-threads": 1, "--no-odirect": 0}


def replay_check(a, trace, server, err_path):
    """Replay the server's route trace (`seq` column) in bmoe-sim and hold its counts of the
    shared decode steps to the server's `bmoe_batch_*_total`: the simulator predicts what the
    batch reads."""
    words, flags = a.server_args.split(), []
    i = 0
    while i < len(words):
        n = SIM_FLAGS.get(words[i].split("=")[0])
        if n is not None:
            flags += words[i:i + 1 + (0 if "=" in words[i] else n)]
            i += 1 + (0 if "=" in words[i] else n)
        else:
            i += 1
    if "O_DIRECT" in open(err_path).read() and "--no-odirect" not in flags:
        flags.append("--no-odirect")  # the server fell back to buffered reads
    cmd = [a.sim, "replay", "--trace", trace] + flags
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return [f"bmoe-sim replay failed: {r.stderr.strip()}"]
    got = {}
    for line in r.stdout.splitlines():
        if line.startswith(("batched: decode_", "sim: ")):
            got.update(kv.split("=", 1) for kv in line.split() if "=" in kv)
    pairs = [("decode_steps", "bmoe_batch_steps_total"), ("decode_rows", "bmoe_batch_rows_total"),
             ("decode_read_bytes", "bmoe_batch_read_bytes_total"),
             ("decode_routed_bytes", "bmoe_batch_routed_bytes_total"),
             ("decode_routings", "bmoe_batch_routings_total")]
    print(f"simulator replay of the server's trace ({' '.join(cmd[1:])}):")
    bad = []
    for ours, theirs in pairs:
        want, have = int(server.get(theirs, 0)), int(got.get(ours, -1))
        print(f"  {ours} = {have}, server's {theirs} = {want}: {'equal' if want == have else 'DIFFERENT'}")
        if want != have:
            bad.append(f"the replay's {ours} {have} differs from the server's {theirs} {want}")
    rows = max(int(got.get("decode_rows", 0)), 1)
    print(f"  the replay reads {int(got.get('decode_read_bytes', 0)) / rows / 2**20:.2f} MiB per generated token "
          f"(whole run: {got.get('hits')} hits, {got.get('misses')} misses, {got.get('evictions')} evictions)")
    return bad


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def soak(a):
    import random
    tmp = tempfile.mkdtemp(prefix="bmoe-serve-soak-")
    model = model_or_tiny(a, tmp)
    args = ["--parallel", str(a.clients), "-c", str(1024 * a.clients)] + a.server_args.split()
    srv, port, err, err_path = start_server(a.bin, model, args, tmp)
    kinds = ["plain", "stream", "legacy", "leave"]

    def ask(kind, p, seed):
        """One request: (status, answer or None)."""
        mt = 8 + seed % 41
        if kind == "legacy":
            body = {"prompt": p, "max_tokens": mt, "temperature": 0}
            path = "/v1/completions"
        else:
            body = {"messages": [{"role": "user", "content": p}], "max_tokens": mt, "temperature": 0}
            path = "/v1/chat/completions"
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        if kind in ("stream", "leave"):
            body["stream"] = True
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            data = r.read()
            c.close()
            return r.status, data.decode(errors="replace")[:200]
        if kind == "leave":
            for _ in range(1 + seed % 4):
                r.readline()
            c.close()  # gone mid-answer
            return 200, None
        if kind == "stream":
            text = ""
            for line in r:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    for ch in json.loads(line[6:]).get("choices", []):
                        text += ch.get("delta", {}).get("content") or ""
            c.close()
            return 200, text
        d = json.loads(r.read())
        c.close()
        ch = d["choices"][0]
        return 200, ch["text"] if kind == "legacy" else ch["message"]["content"]

    refs = {}

    def reference(kind, p, seed):
        k = ("legacy" if kind == "legacy" else "chat", p, 8 + seed % 41)
        if k not in refs:
            st, ans = ask("plain" if kind != "legacy" else "legacy", p, seed)
            if st != 200:
                sys.exit(f"reference request failed: {st} {ans}")
            refs[k] = ans
        return refs[k]

    failures, counts, statuses = [], {}, {}
    lock = threading.Lock()
    samples = []
    try:
        # The references, alone, before the clients start (and a warm-up).
        for p in PROMPTS[: a.clients]:
            for seed in range(41):
                reference("plain", p, seed)
                reference("legacy", p, seed)
        base = (rss_mib(srv.pid), fds(srv.pid))
        deadline = time.time() + a.soak

        def client(i):
            rng = random.Random(i)
            p = PROMPTS[i]
            while time.time() < deadline:
                kind, seed = rng.choice(kinds), rng.randrange(1 << 30)
                try:
                    st, ans = ask(kind, p, seed)
                except Exception as e:
                    st, ans = -1, str(e)
                with lock:
                    counts[kind] = counts.get(kind, 0) + 1
                    statuses[st] = statuses.get(st, 0) + 1
                    if st != 200 and st != 503:
                        failures.append(f"{kind}: {st} {ans}")
                    elif st == 200 and ans is not None and ans != reference(kind, p, seed):
                        failures.append(f"{kind} {p!r} max_tokens {8 + seed % 41}: {ans!r} alone was {reference(kind, p, seed)!r}")

        def sampler(stop):
            while not stop.is_set():
                samples.append((time.time(), rss_mib(srv.pid), fds(srv.pid)))
                stop.wait(2.0)

        stop = threading.Event()
        s = threading.Thread(target=sampler, args=(stop,))
        s.start()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        stop.set()
        s.join()
        time.sleep(1.0)
        end = (rss_mib(srv.pid), fds(srv.pid))
        m = metrics(port)
        total = sum(counts.values())
        print(f"soak: {wall / 60:.1f} min, {a.clients} clients, server {' '.join(args)}")
        print(f"requests {total}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        print("statuses: " + ", ".join(f"{k} x {v}" for k, v in sorted(statuses.items())))
        print(f"server RSS MiB: {base[0]:.1f} after the references, max {max(x[1] for x in samples):.1f}, {end[0]:.1f} at the end")
        print(f"open fds: {base[1]} after the references, max {max(x[2] for x in samples)}, {end[1]} at the end "
              f"({len(samples)} samples)")
        print(f"shared steps {m.get('bmoe_batch_steps_total', 0):.0f}, mean batch "
              f"{m.get('bmoe_batch_rows_total', 0) / max(m.get('bmoe_batch_steps_total', 1), 1):.2f}, "
              f"cancelled {m.get('bmoe_requests_cancelled_total', 0):.0f}")
        print(f"answers checked against their answer alone: {total - counts.get('leave', 0)}, differing: "
              f"{sum(1 for f in failures if 'alone was' in f)}")
        if end[0] > base[0] * 1.10 + 8:
            failures.append(f"RSS grew from {base[0]:.1f} to {end[0]:.1f} MiB")
        if end[1] > base[1]:
            failures.append(f"open fds grew from {base[1]} to {end[1]}")
    finally:
        srv.terminate()
        code = srv.wait(timeout=60)
        err.close()
    if code != 0:
        failures.append(f"the server exited {code} on SIGTERM")
    for f in failures[:20]:
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
    ap.add_argument("--server-args", default="", help="more serve flags (--scaling, --soak)")
    ap.add_argument("--cap-mib", type=int, help="--scaling: run the server in a cgroup v1 memory cap of this many MiB (root)")
    ap.add_argument("--sim", help="--scaling: bmoe-sim binary; record the server's route trace and hold its replay's counts to the server's metrics")
    ap.add_argument("--together", action="store_true", help="--scaling: every client starts at once (default: spread over one lone request)")
    ap.add_argument("--soak", type=float, help="seconds of mixed requests against --parallel (--clients of them)")
    a = ap.parse_args()
    a.bin = os.path.abspath(a.bin)
    if a.model:
        a.model = os.path.abspath(a.model)
    if a.soak:
        return soak(a)
    if a.scaling:
        if not a.model:
            sys.exit("--scaling needs --model")
        a.max_tokens = a.max_tokens or 64
        return scaling(a)
    a.max_tokens = a.max_tokens or 16
    if a.clients > len(PROMPTS):
        sys.exit(f"--clients: at most {len(PROMPTS)}")
    tmp = tempfile.mkdtemp(prefix="bmoe-serve-load-")
    model = model_or_tiny(a, tmp)
    srv, port, err, _ = start_server(a.bin, model, ["-c", "2048", "--queue", str(a.queue)], tmp)
    failures = []
    try:
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
