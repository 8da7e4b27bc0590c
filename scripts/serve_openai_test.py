#!/usr/bin/env python3
"""`bmoe-cli serve` against the real `openai` Python client (issue 18, "Done when").

Run by engine/tests/serve_openai.rs (CI) as

    python3 scripts/serve_openai_test.py --bin BMOE_CLI --model TINY.gguf --workdir DIR

It starts the server on a free loopback port in an empty working directory and checks:
a plain and a streamed chat completion equal to the same request through `--session`; a
3-turn conversation whose later turns report cached_tokens > 0 and prefill fewer tokens; a
stream the client closes after 3 chunks (the next request is served, and the cancelled
generation stopped within one token of the server learning the client had gone); the bad
inputs (malformed JSON, wrong types, unknown roles, empty messages, a prompt over the
context, a body over the limit, a slow client, an unknown path, a foreign Host or Origin, a
missing or wrong API key, a full queue); /v1/completions, /v1/models, /health; and /metrics
parsed with prometheus_client. The server must keep serving throughout, and write nothing
in its working directory. Exit 0 when every check passed.
"""

import argparse
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import jsonschema
import openai
from prometheus_client.parser import text_string_to_metric_families

KEY = "sk-bmoe-test"
CTX = 1024


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)
    print(f"ok: {msg}")


class Server:
    def __init__(self, binary, model, workdir, extra, name="serve", ctx=CTX):
        self.err_path = os.path.join(os.path.dirname(workdir), f"{name}.stderr")
        self.err = open(self.err_path, "w")
        self.proc = subprocess.Popen(
            [binary, "serve", "-m", model, "--port", "0", "-c", str(ctx), "-n", "16"] + extra,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.err,
        )
        deadline = time.time() + 60
        self.port = None
        while time.time() < deadline and self.port is None:
            if self.proc.poll() is not None:
                fail(f"serve exited {self.proc.returncode}: {open(self.err_path).read()}")
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", open(self.err_path).read())
            if m:
                self.port = int(m.group(1))
            time.sleep(0.05)
        if self.port is None:
            fail("the server never said where it listens")
        while time.time() < deadline:
            st, body, _ = self.request("GET", "/health")
            if st == 200 and json.loads(body)["status"] == "ready":
                return
            check(st == 503 and json.loads(body)["status"] == "loading", "/health says loading first")
            time.sleep(0.05)
        fail("the model never became ready")

    def request(self, method, path, body=None, headers=None, auth=True):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Content-Type": "application/json"}
        if auth:
            h["Authorization"] = f"Bearer {KEY}"
        h.update(headers or {})
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data, dict(r.getheaders())

    def metrics(self):
        st, body, hdr = self.request("GET", "/metrics")
        check(st == 200 and hdr.get("content-type", "").startswith("text/plain"), "/metrics answers text")
        out = {}
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def stop(self):
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            fail("the server did not stop on SIGTERM")
        self.err.close()
        return code


def metric(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def session_answer(binary, model, workdir, prompt, n):
    """The same request through `bmoe-cli --session --chatml`: (reasoning, text)."""
    req = json.dumps({"cmd": "generate", "id": 1, "prompt": prompt, "n_predict": n}) + "\n"
    # stdin stays open until the answer: EOF would close the session and cancel the turn.
    p = subprocess.Popen(
        [binary, "-m", model, "--session", "--chatml", "-c", str(CTX)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=workdir,
    )
    p.stdin.write(req)
    p.stdin.flush()
    done = None
    for line in p.stdout:
        if line.startswith("BMOE_DONE "):
            done = json.loads(line[len("BMOE_DONE "):])
            break
        if line.startswith("BMOE_ERROR "):
            break
    p.stdin.close()
    p.wait(timeout=60)
    if done is None or done["cancelled"]:
        fail(f"--session gave no whole answer: {done}")
    return done["reasoning"], done["text"]


def error_of(st, body, status, needle, param=None):
    d = json.loads(body)
    e = d.get("error", {})
    return (
        st == status
        and needle in e.get("message", "")
        and isinstance(e.get("type"), str)
        and (param is None or e.get("param") == param)
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--templates", help="../shared/data/templates: the tool-call round trips run on models with these templates")
    a = ap.parse_args()
    a.bin, a.model, a.workdir = (os.path.abspath(p) for p in (a.bin, a.model, a.workdir))
    os.makedirs(a.workdir, exist_ok=True)
    check(os.listdir(a.workdir) == [], "the server's working directory starts empty")
    srv = Server(
        a.bin,
        a.model,
        a.workdir,
        ["--api-key", KEY, "--queue", "1", "--body-limit-kib", "64", "--read-timeout", "1", "--cors-origin", "http://app.example"],
    )
    try:
        run(a, srv)
    finally:
        code = srv.stop()
    check(code == 0, f"the server stopped cleanly on SIGTERM (exit {code})")
    log = open(srv.err_path).read()
    check(re.search(r"^bmoe: serve: mode: ", log, re.M) is not None, "the server prints its mode: line")
    check(re.search(r'^bmoe: serve: 127\.0\.0\.1 "POST /v1/chat/completions" 200 [0-9.]+ s$', log, re.M) is not None
          and re.search(r'"GET /v1/nothing" 404', log) is not None, "one access-log line per request (peer, method, path, status, time)")
    left = os.listdir(a.workdir)
    check(left == [], f"the server wrote nothing in its working directory ({left})")
    parallel(a)
    if a.templates:
        tool_round_trips(a)
    else:
        print("skipped: the tool-call round trips (no --templates)")
    print("all checks passed")


def parallel(a):
    """`--parallel 3`: concurrent requests (chat plain and streamed, legacy with n=2, a stop
    string, logprobs, a client that leaves mid-stream) decode together and each greedy answer
    equals the one-at-a-time server's."""
    import threading
    one = Server(a.bin, a.model, a.workdir, ["--api-key", KEY], name="serve-one")
    threads = []
    many = Server(a.bin, a.model, a.workdir, ["--api-key", KEY, "--parallel", "3"], name="serve-many", ctx=3 * CTX)
    jobs = [
        ("chat", {"messages": [{"role": "user", "content": "Tell me about the fox"}], "max_tokens": 24}),
        ("chat-stream", {"messages": [{"role": "user", "content": "And the river?"}], "max_tokens": 20}),
        ("legacy", {"prompt": "Once upon a time", "max_tokens": 12, "n": 2, "logprobs": 2}),
        ("chat", {"messages": [{"role": "user", "content": "Count to ten"}], "max_tokens": 16, "stop": ["e"]}),
        ("legacy", {"prompt": "The quick brown fox", "max_tokens": 30}),
        ("chat-stream", {"messages": [{"role": "user", "content": "Say something long"}], "max_tokens": 24}),
    ]

    def answer(srv, kind, body):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key=KEY, max_retries=0, timeout=120)
        body = dict(body, temperature=0)
        if kind == "legacy":
            r = client.completions.create(model="m", **body)
            return [(c.index, c.text, c.finish_reason, c.logprobs.tokens if c.logprobs else None) for c in r.choices]
        if kind == "chat":
            r = client.chat.completions.create(model="m", **body)
            return [(c.index, c.message.content, c.finish_reason) for c in r.choices]
        text, finish = "", None
        for ch in client.chat.completions.create(model="m", stream=True, **body):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        return [(0, text, finish)]

    def leaver(srv):
        # Reads three chunks, then goes away: its lane is cancelled, the others go on.
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        body = json.dumps({"messages": [{"role": "user", "content": "Never mind"}], "max_tokens": 200, "stream": True})
        c.request("POST", "/v1/chat/completions", body=body,
                  headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        r = c.getresponse()
        for _ in range(3):
            r.readline()
        c.close()

    try:
        want = [answer(one, k, b) for k, b in jobs]
        got = [None] * len(jobs)

        def run_job(i):
            got[i] = answer(many, *jobs[i])
        threads = [threading.Thread(target=run_job, args=(i,)) for i in range(len(jobs))]
        threads.append(threading.Thread(target=leaver, args=(many,)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, (g, w) in enumerate(zip(got, want)):
            check(g == w, f"--parallel: request {i} ({jobs[i][0]}) answers as it does alone")
        m = many.metrics()
        steps, rows = metric(m, "bmoe_batch_steps_total"), metric(m, "bmoe_batch_rows_total")
        check(rows > steps > 0, f"--parallel: requests shared decode steps ({rows:.0f} rows in {steps:.0f} steps)")
        st, body, _ = many.request("GET", "/props")
        check(st == 200 and json.loads(body)["total_slots"] == 3, "/props counts the slots")
        st, body, _ = many.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "ngram": True})
        check(st == 400 and json.loads(body)["error"]["param"] == "ngram", "--parallel: a drafting request is a 400 naming ngram")
        # SIGTERM while two requests run and three wait: every one is answered (503: the
        # server is stopping), and the server exits 0.
        late = []

        def long_one(i):
            st, body, _ = many.request("POST", "/v1/completions", {"prompt": f"long {i}", "max_tokens": 900, "n": 1 + i % 2})
            late.append(st)
        threads = [threading.Thread(target=long_one, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        time.sleep(0.5)
    finally:
        codes = (one.stop(), many.stop())
    for t in threads:
        t.join()
    check(codes == (0, 0), f"both servers stopped cleanly on SIGTERM ({codes})")
    check(len(late) == 5 and all(st in (200, 503) for st in late),
          f"--parallel: SIGTERM answers every running and waiting request ({sorted(late)})")
    log = open(many.err_path).read()
    check("3 slots of" in log, "the parallel server says how many slots it decodes together")


def run(a, srv):
    base = f"http://127.0.0.1:{srv.port}/v1"
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)

    # /v1/models and /health.
    models = client.models.list()
    check([m.id for m in models.data] == [os.path.splitext(os.path.basename(a.model))[0]], "/v1/models lists the model")
    st, body, _ = srv.request("GET", "/health", auth=False)
    check(st == 200 and json.loads(body) == {"status": "ready"}, "/health needs no key and says ready")

    # A plain and a streamed chat completion, equal to --session.
    prompt, n = "Tell me about the river.", 24
    want_reasoning, want_text = session_answer(a.bin, a.model, os.path.dirname(a.workdir), prompt, n)
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=n, temperature=0
    )
    msg = r.choices[0].message
    got_reasoning = (msg.model_extra or {}).get("reasoning_content") or ""
    check(msg.content == want_text, f"plain chat text equals --session's ({msg.content!r})")
    check(got_reasoning == want_reasoning, "plain chat reasoning_content equals --session's reasoning")
    check(r.choices[0].finish_reason in ("stop", "length"), "finish_reason is stop or length")
    check(r.usage.completion_tokens <= n and r.usage.prompt_tokens > 0, "usage counts the tokens")
    tel = r.model_extra["bmoe"]
    check(tel["tokens"] == r.usage.completion_tokens and "tok_s" in tel and "cache_hit_pct" in tel, "the bmoe telemetry extension carries the BMOE_DONE keys")
    check("text" not in tel and "reasoning" not in tel, "the extension does not repeat the text")

    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, reasoning, finish, usage, ext = "", "", None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            finish = c.finish_reason or finish
        ext = (chunk.model_extra or {}).get("bmoe") or ext
    check(text == want_text, "streamed chat text equals --session's")
    check(reasoning == want_reasoning, "streamed reasoning_content equals --session's")
    check(finish == r.choices[0].finish_reason, "the stream ends with the same finish_reason")
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, "include_usage sends a usage chunk")
    check(ext is not None and ext["tokens"] == usage.completion_tokens, "the stream's last chunk carries the telemetry")

    # A 3-turn conversation: later turns reuse the KV.
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    prompts, cached = [], []
    for turn, follow in enumerate(["And another?", "One more, please."]):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
        prompts.append(r.usage.prompt_tokens)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        msgs.append({"role": "user", "content": follow})
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    prompts.append(r.usage.prompt_tokens)
    cached.append(r.usage.prompt_tokens_details.cached_tokens)
    prefilled = [p - c for p, c in zip(prompts, cached)]
    print(f"   3 turns: prompt tokens {prompts}, cached {cached}, prefilled {prefilled}")
    check(all(c > 0 for c in cached[1:]), "turns 2 and 3 report cached_tokens > 0")
    check(all(prefilled[i] < prompts[i] for i in (1, 2)), "turns 2 and 3 prefill fewer tokens than their prompt")
    check(r.model_extra["bmoe"]["n_reused"] == cached[2], "the telemetry's n_reused is cached_tokens")

    # A stream the client closes after 3 chunks.
    before = srv.metrics()
    long_n = 900
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Write a long story."}], max_tokens=long_n, temperature=0, stream=True
    )
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Still there?"}], max_tokens=5, temperature=0
    )
    check(r.choices[0].message.content is not None, "the request after a closed stream is served")
    after = srv.metrics()
    cancelled = metric(after, "bmoe_requests_cancelled_total") - metric(before, "bmoe_requests_cancelled_total")
    check(cancelled == 1, "the closed stream's generation was cancelled")
    overrun = metric(after, "bmoe_cancel_overrun_tokens")
    check(overrun <= 1, f"it stopped within one token of the server noticing ({overrun:.0f} tokens after)")
    gen = metric(after, "bmoe_completion_tokens_total") - metric(before, "bmoe_completion_tokens_total") - r.usage.completion_tokens
    check(gen < long_n, f"the cancelled generation made {gen:.0f} of its {long_n} tokens")

    # A full queue (--queue 1): one generates, one waits, a third is 503 with Retry-After.
    def long_stream(content):
        return client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=long_n, temperature=0, stream=True
        )

    first = long_stream("Another long story.")
    # One iterator kept alive: a discarded generator closes the response (and cancels it).
    first_events = iter(first)
    next(first_events)
    waiting = {}
    t = threading.Thread(target=lambda: waiting.setdefault("s", long_stream("A third long story.")))
    t.start()
    deadline = time.time() + 30
    while metric(srv.metrics(), "bmoe_requests_in_flight") < 2 and time.time() < deadline:
        time.sleep(0.02)
    st, body, hdr = srv.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    check(st == 503 and "retry-after" in {k.lower() for k in hdr} and error_of(st, body, 503, "busy"), "a request past the queue is 503 with Retry-After")
    try:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        fail("the openai client got no error from a full queue")
    except openai.APIStatusError as e:
        check(e.status_code == 503, "the openai client sees the 503")
    time.sleep(0.2)
    check(sum(1 for _ in zip(range(5), first_events)) == 5, "the running stream kept streaming meanwhile")
    first.close()
    t.join(timeout=60)
    check("s" in waiting, "the queued request starts when the one before it is cancelled")
    next(iter(waiting["s"]))
    waiting["s"].close()

    # Bad inputs: each a clear error in the OpenAI shape.
    chat = "/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ("malformed JSON", chat, '{"messages": [', 400, "not valid JSON", None),
        ("wrong type", chat, {"messages": user, "max_tokens": "8"}, 400, "max_tokens", "max_tokens"),
        ("wrong type", chat, {"messages": "hi"}, 400, "expected an array", "messages"),
        ("unknown role", chat, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "unknown role", "messages[0].role"),
        ("empty messages", chat, {"messages": []}, 400, "empty", "messages"),
        ("over the context", chat, {"messages": [{"role": "user", "content": "word " * (CTX * 2)}]}, 400, "context", "messages"),
        ("over the context", "/v1/completions", {"prompt": "word " * (CTX * 2)}, 400, "context", "prompt"),
        ("the MTP head on a server without --mtp", chat, {"messages": user, "mtp": True}, 400, "started with --mtp", "mtp"),
        ("body over the limit", chat, json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}), 413, "limit", None),
    ]
    for what, path, body, status, needle, param in cases:
        st, data, _ = srv.request("POST", path, body)
        check(error_of(st, data, status, needle, param), f"{what}: {status} ({json.loads(data)['error']['message'][:70]})")
    st, data, _ = srv.request("POST", chat, {"messages": [{"role": "user", "content": "word " * (CTX * 2)}]})
    check(json.loads(data)["error"]["code"] == "context_length_exceeded", "over the context: code context_length_exceeded")
    st, data, _ = srv.request("GET", "/v1/nothing")
    check(error_of(st, data, 404, "unknown path"), "an unknown path is 404")
    st, data, _ = srv.request("GET", chat)
    check(st == 405, "a wrong method is 405")
    st, data, _ = srv.request("GET", "/v1/models", headers={"Host": "evil.example:80"})
    check(error_of(st, data, 403, "not loopback"), "a foreign Host on a loopback bind is 403")
    st, data, _ = srv.request("POST", chat, {"messages": user}, headers={"Origin": "http://evil.example"})
    check(error_of(st, data, 403, "Origin"), "a foreign Origin is 403")
    st, data, _ = srv.request("POST", chat, {"messages": user, "max_tokens": 2}, headers={"Origin": "http://localhost:3000"})
    check(st == 200, "a loopback Origin is served")
    # CORS: the --cors-origin page gets its preflight answered and may read answers.
    st, data, hdr = srv.request("OPTIONS", chat, None, headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}, auth=False)
    h = {k.lower(): v for k, v in hdr.items()}
    check(st == 204 and h.get("access-control-allow-origin") == "http://app.example" and "POST" in h.get("access-control-allow-methods", ""),
          "a CORS preflight from --cors-origin is answered 204 with its allowances")
    st, data, hdr = srv.request("POST", chat, {"messages": user, "max_tokens": 2}, headers={"Origin": "http://app.example"})
    check(st == 200 and {k.lower(): v for k, v in hdr.items()}.get("access-control-allow-origin") == "http://app.example", "the --cors-origin page's request is served with Access-Control-Allow-Origin")
    st, data, hdr = srv.request("OPTIONS", chat, None, headers={"Origin": "http://evil.example"}, auth=False)
    check(st != 204 and "access-control-allow-origin" not in {k.lower() for k in hdr}, "a preflight from another origin gets no CORS allowance")
    st, data, _ = srv.request("GET", "/v1/models", auth=False)
    check(error_of(st, data, 401, "missing API key"), "no API key is 401")
    bad = openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0)
    try:
        bad.models.list()
        fail("a wrong key was accepted")
    except openai.AuthenticationError:
        check(True, "a wrong API key is 401 (openai.AuthenticationError)")
    # A slow client: headers, then part of the body, then nothing.
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(
        f"POST {chat} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mess".encode()
    )
    s.settimeout(10)
    t0 = time.time()
    resp = b""
    try:
        while b"\r\n\r\n" not in resp:
            chunk = s.recv(4096)
            if not chunk:
                break
            resp += chunk
    except socket.timeout:
        pass
    s.close()
    check(resp.startswith(b"HTTP/1.1 408"), f"a body that does not arrive is 408 after {time.time() - t0:.1f} s")
    # A client that disconnects mid-request (body half sent, connection closed).
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(f"POST {chat} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 50\r\n\r\n{{".encode())
    s.close()

    # Raw completions, plain and streamed.
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    text = r.choices[0].text
    check(r.usage.completion_tokens > 0 and r.choices[0].finish_reason in ("stop", "length"), "/v1/completions answers")
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if c.choices)
    check(streamed == text, "a streamed completion equals the plain one")
    # Stop strings end the answer before them.
    if len(text) > 4:
        stop = text[2:4]
        r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stop=[stop])
        check(r.choices[0].text == text[: text.index(stop)] and r.choices[0].finish_reason == "stop", f"stop {stop!r} cuts the text before it")

    surface(client, srv)
    structured(client, srv)

    # Still serving; /metrics parsed.
    r = client.chat.completions.create(model="tiny", messages=user, max_tokens=3)
    check(r.choices[0].message.content is not None, "the server still serves after every bad input")
    m = srv.metrics()
    check(metric(m, "bmoe_ready") == 1, "/metrics: bmoe_ready 1")
    check(metric(m, "bmoe_requests_total", endpoint="/v1/chat/completions", status="200") >= 8, "/metrics counts the 200s")
    check(metric(m, "bmoe_requests_total", endpoint="/v1/chat/completions", status="400") >= 6, "/metrics counts the 400s")
    check(metric(m, "bmoe_requests_total", endpoint="other", status="404") >= 1, "/metrics counts unknown paths under 'other'")
    check(metric(m, "bmoe_cached_tokens_total") > 0, "/metrics counts the reused tokens")
    check(metric(m, "bmoe_decode_tokens_per_second") > 0, "/metrics has the decode rate")
    check(metric(m, "bmoe_requests_rejected_busy_total") >= 2, "/metrics counts the 503s")
    check(metric(m, "bmoe_requests_in_flight") == 0, "nothing is left in flight")


def repeats(ids):
    return len(ids) - len(set(ids))


def surface(client, srv):
    """The request surface past the basics (issue 35, item 3): log-probabilities, n choices,
    the penalties, logit_bias, min_p; and a 400 naming each field this server does not honour."""
    user = [{"role": "user", "content": "Tell me about the river."}]
    plain = client.chat.completions.create(model="tiny", messages=user, max_tokens=24, temperature=0)
    r = client.chat.completions.create(
        model="tiny", messages=user, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3
    )
    check(r.choices[0].message.content == plain.choices[0].message.content, "asking for logprobs leaves the answer as it was")
    lps = r.choices[0].logprobs.content
    check(len(lps) == r.usage.completion_tokens, f"one logprob per answer token ({len(lps)})")
    check(all(len(e.top_logprobs) == 3 for e in lps), "top_logprobs: 3 alternatives each")
    check(all(e.logprob <= 0 for e in lps), "log-probabilities are <= 0")
    check(all(e.top_logprobs[i].logprob >= e.top_logprobs[i + 1].logprob for e in lps for i in range(2)), "alternatives come most likely first")
    # Greedy: the chosen token is the most likely one.
    check(all(abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6 and e.token == e.top_logprobs[0].token for e in lps), "greedy picks the top alternative")
    check(all(bytes(e.bytes) == e.token.encode() for e in lps if "\ufffd" not in e.token), "bytes are the token's text")
    ids = [e.model_extra["id"] for e in lps]
    stream = client.chat.completions.create(
        model="tiny", messages=user, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [e for c in stream for ch in c.choices if ch.logprobs and ch.logprobs.content for e in ch.logprobs.content]
    check([(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in lps], "streamed logprobs equal the plain response's")

    # Legacy completions: logprobs as parallel lists.
    c = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens, "legacy logprobs: one entry per token")
    check(all(len(t) == 2 for t in lp.top_logprobs), "legacy top_logprobs: 2 alternatives each")
    check(lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0, "legacy text_offset counts up from 0")
    sc = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2, stream=True)
    check([t for ch in sc if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens] == lp.tokens, "streamed legacy logprobs list the same tokens")

    # n choices: each seeded from the request's seed plus its index, reproducible.
    def sampled(n, seed):
        r = client.chat.completions.create(model="tiny", messages=user, max_tokens=12, temperature=1.0, seed=seed, n=n)
        return r, [ch.message.content for ch in sorted(r.choices, key=lambda ch: ch.index)]
    r3, three = sampled(3, 7)
    check([ch.index for ch in r3.choices] == [0, 1, 2], "n=3 answers three choices")
    per_choice = [t["tokens"] for t in r3.model_extra["bmoe"]]
    check(len(per_choice) == 3 and r3.usage.completion_tokens == sum(per_choice), f"usage sums the choices' tokens {per_choice}")
    check(sampled(3, 7)[1] == three, "the same seed gives the same three choices")
    check(sampled(1, 7)[1] == three[:1], "choice 0 of n=3 is the n=1 answer of the same seed")
    check(len(set(three)) > 1, "sampled choices differ")
    g = client.chat.completions.create(model="tiny", messages=user, max_tokens=24, temperature=0, n=2)
    check([ch.message.content for ch in g.choices] == [plain.choices[0].message.content] * 2, "greedy n=2 repeats the greedy answer")
    check(isinstance(g.model_extra["bmoe"], list) and len(g.model_extra["bmoe"]) == 2, "n=2: the telemetry is a list of two")
    parts = {}
    for chunk in client.chat.completions.create(model="tiny", messages=user, max_tokens=24, temperature=0, n=2, stream=True):
        for ch in chunk.choices:
            parts[ch.index] = parts.get(ch.index, "") + (ch.delta.content or "")
    check(parts == {0: plain.choices[0].message.content, 1: plain.choices[0].message.content}, "streamed n=2: each index carries its whole answer")

    # Penalties and biases.
    neutral = client.chat.completions.create(
        model="tiny", messages=user, max_tokens=24, temperature=0,
        presence_penalty=0, frequency_penalty=0, extra_body={"repeat_penalty": 1.0, "min_p": 0.05},
    )
    check(neutral.choices[0].message.content == plain.choices[0].message.content, "neutral penalties (and min_p, greedy) change nothing")
    # The additive penalties, checked token by token: each choice is the argmax of the raw
    # log-probabilities (top 20) minus count*frequency + presence over the last repeat_last_n
    # tokens of the prompt (from /tokenize) and the answer so far.
    text = ("The river runs past the old mill, under the stone bridge, through the town where the "
            "baker and the smith trade stories about the flood of the last spring and the one before it.")
    st, body, _ = srv.request("POST", "/tokenize", {"content": text, "add_special": True})
    check(st == 200, "/tokenize answers")
    prompt_ids = json.loads(body)["tokens"]
    last_n = 64
    for presence, frequency in [(0.3, 0.0), (0.0, 0.3)]:
        window = list(prompt_ids)
        pc = client.completions.create(
            model="tiny", prompt=text, max_tokens=64, temperature=0, logprobs=20,
            presence_penalty=presence, frequency_penalty=frequency, extra_body={"repeat_last_n": last_n},
        )
        steps = pc.choices[0].logprobs.model_extra["content"]
        flips, decided = 0, 0
        for e in steps:
            recent = window[-last_n:]
            scored = sorted(
                ((t["logprob"] - (recent.count(t["id"]) * frequency + presence if t["id"] in recent else 0.0), -t["id"], t["id"])
                 for t in e["top_logprobs"]),
                reverse=True,
            )
            # Decided within the top 20 when the winner still beats the 20th raw log-probability.
            if scored[0][0] >= e["top_logprobs"][-1]["logprob"]:
                decided += 1
                if scored[0][2] != e["id"]:
                    fail(f"penalised greedy chose {e['id']}, the formula says {scored[0][2]}")
            flips += e["id"] != e["top_logprobs"][0]["id"]
            window.append(e["id"])
        print(f"   presence {presence}, frequency {frequency}: {decided} of {len(steps)} steps decided within the top 20, {flips} chose other than the raw top token")
        check(decided >= len(steps) // 2 and flips > 0, f"presence_penalty {presence} frequency_penalty {frequency} follow OpenAI's formula over the window")
    raw = client.completions.create(model="tiny", prompt=text, max_tokens=32, temperature=0)
    pen = client.completions.create(model="tiny", prompt=text, max_tokens=32, temperature=0, extra_body={"repeat_penalty": 3.0})
    check(pen.choices[0].text != raw.choices[0].text, "repeat_penalty changes the greedy answer")
    banned = max(set(ids), key=ids.count)
    b = client.chat.completions.create(
        model="tiny", messages=user, max_tokens=24, temperature=0, logprobs=True, logit_bias={str(banned): -100}
    )
    b_ids = [e.model_extra["id"] for e in b.choices[0].logprobs.content]
    check(banned not in b_ids, f"logit_bias -100 bans token {banned} (it appeared {ids.count(banned)}x before)")
    st, body, _ = srv.request("POST", "/v1/chat/completions", {"messages": user, "logit_bias": {"999999999": 1}})
    check(error_of(st, body, 400, "outside the vocabulary", "logit_bias"), "a logit_bias id past the vocabulary is 400")

    # /tokenize, /detokenize, /props, /v1/models/{id}.
    st, body, _ = srv.request("POST", "/tokenize", {"content": "Once upon a time", "with_pieces": True})
    pieces = json.loads(body)["tokens"]
    check(st == 200 and "".join(p["piece"] for p in pieces) == "Once upon a time", "/tokenize with_pieces: the pieces spell the text")
    st, body, _ = srv.request("POST", "/detokenize", {"tokens": [p["id"] for p in pieces]})
    check(st == 200 and json.loads(body)["content"] == "Once upon a time", "/detokenize inverts /tokenize")
    st, body, _ = srv.request("POST", "/detokenize", {"tokens": [1, 99999999]})
    check(error_of(st, body, 400, "outside the vocabulary", "tokens"), "/detokenize of an id past the vocabulary is 400")
    st, body, _ = srv.request("POST", "/tokenize", {"text": "x"})
    check(error_of(st, body, 400, "missing", "content"), "/tokenize without content is 400")
    st, body, _ = srv.request("GET", "/props")
    props = json.loads(body)
    check(st == 200 and props["n_ctx"] == CTX and props["total_slots"] == 1 and "default_generation_settings" in props, "/props describes the model and defaults")
    mid = client.models.list().data[0].id
    check(client.models.retrieve(mid).id == mid, "/v1/models/{id} answers the served model")
    try:
        client.models.retrieve("no-such-model")
        fail("/v1/models/no-such-model answered")
    except openai.NotFoundError:
        check(True, "/v1/models/{other} is 404")

    # What is not honoured is a 400 naming the field, never a silent 200.
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    for what, extra, param in [
        ("tools on a template with no tool-call syntax", {"tools": [tool]}, "tools"),
        ("tool_choice required without tools", {"tool_choice": "required"}, "tool_choice"),
        ("mirostat", {"mirostat": 2}, "mirostat"),
        ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ]:
        try:
            client.chat.completions.create(model="tiny", messages=user, max_tokens=2, extra_body=extra)
            fail(f"{what}: answered 200")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and (e.body or {}).get("param") == param, f"{what}: 400 naming {param}")
    for what, extra, param in [("best_of", {"best_of": 3}, "best_of"), ("suffix", {"suffix": "end"}, "suffix")]:
        try:
            client.completions.create(model="tiny", prompt="a", max_tokens=2, extra_body=extra)
            fail(f"{what}: answered 200")
        except openai.BadRequestError as e:
            check((e.body or {}).get("param") == param, f"legacy {what}: 400 naming {param}")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city over the next days",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False},
    },
}


def tool_round_trips(a):
    """Tool calling (issue 35, item 1) on the three template families we read, each on a
    random-weight model with its real template: a required call is made, parses and fits its
    schema; a named one calls that tool; streamed deltas assemble to the same call; the call
    and the tool's answer go back into the conversation and are answered; "none" reads nothing."""
    base_dir = os.path.dirname(a.workdir)
    for arch, template in [
        ("qwen3moe", "Qwen-Qwen3-0.6B.jinja"),
        ("gpt-oss", "openai-gpt-oss-120b.jinja"),
        ("gemma4", "google-gemma-4-31B-it.jinja"),
    ]:
        model = os.path.join(base_dir, f"tools-{arch}.gguf")
        subprocess.run(
            [a.bin, "gen", "--arch", arch, "--preset", "tiny", "--quiet", "--template", os.path.join(a.templates, template), "-o", model],
            check=True,
        )
        cwd = os.path.join(base_dir, f"cwd-{arch}")
        os.makedirs(cwd, exist_ok=True)
        srv = Server(a.bin, model, cwd, ["--api-key", KEY])
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key=KEY, max_retries=0, timeout=120)
            user = [{"role": "user", "content": "What is the weather in Paris this week?"}]
            if arch == "gpt-oss":
                # Its template writes reasoning_effort into the system message.
                said = []
                for effort in ("low", "high"):
                    r = client.chat.completions.create(model="t", messages=user, max_tokens=12, temperature=0, reasoning_effort=effort)
                    said.append((r.usage.prompt_tokens, r.choices[0].message.content, r.choices[0].message.model_extra.get("reasoning_content")))
                check(said[0] != said[1], f"{arch}: reasoning_effort reaches the template (low and high answer differently)")
            else:
                st, body, _ = srv.request("POST", "/v1/chat/completions", {"messages": user, "reasoning_effort": "low"})
                check(error_of(st, body, 400, "reads no reasoning_effort", "reasoning_effort"),
                      f"{arch}: reasoning_effort on a template that reads none is a 400 naming it")
            r = client.chat.completions.create(model="t", messages=user, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200, temperature=0)
            ch = r.choices[0]
            calls = ch.message.tool_calls or []
            check(ch.finish_reason == "tool_calls" and len(calls) == 1, f"{arch}: tool_choice required makes one call ({ch.finish_reason})")
            call = calls[0]
            args = json.loads(call.function.arguments)
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
            jsonschema.validate(args, schema)
            check(call.id and call.type == "function", f"{arch}: the call {call.function.name}({call.function.arguments}) fits its schema and has an id")
            r = client.chat.completions.create(model="t", messages=user, tools=[WEATHER, TIME], max_tokens=200, temperature=0.7, seed=1,
                                               tool_choice={"type": "function", "function": {"name": "get_time"}})
            named = r.choices[0].message.tool_calls or []
            check(len(named) == 1 and named[0].function.name == "get_time" and json.loads(named[0].function.arguments)["zone"] in ("UTC", "CET"), f"{arch}: a named tool_choice calls that tool")
            for seed in range(3):
                r = client.chat.completions.create(model="t", messages=user, tools=[WEATHER, TIME], max_tokens=200, temperature=1.0, seed=seed,
                                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
                w = r.choices[0].message.tool_calls or []
                if len(w) != 1 or w[0].function.name != "get_weather":
                    fail(f"{arch}: seed {seed}: no get_weather call: {r.choices[0].message}")
                jsonschema.validate(json.loads(w[0].function.arguments), WEATHER["function"]["parameters"])
            check(True, f"{arch}: sampled get_weather calls (3 seeds) fit the schema's lengths and ranges")
            stream = client.chat.completions.create(model="t", messages=user, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200, temperature=0, stream=True)
            parts, finish = {}, None
            for chunk in stream:
                for c in chunk.choices:
                    finish = c.finish_reason or finish
                    for tc in c.delta.tool_calls or []:
                        d = parts.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                        d["id"] += tc.id or ""
                        d["name"] += (tc.function.name or "") if tc.function else ""
                        d["arguments"] += (tc.function.arguments or "") if tc.function else ""
            check(finish == "tool_calls" and parts == {0: {"id": parts[0]["id"], "name": call.function.name, "arguments": call.function.arguments}}, f"{arch}: streamed tool-call deltas assemble to the same call")
            follow = user + [
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": "18 C and sunny"},
            ]
            r2 = client.chat.completions.create(model="t", messages=follow, tools=[WEATHER, TIME], tool_choice="none", max_tokens=12, temperature=0)
            check(r2.choices[0].message.content is not None and r2.choices[0].finish_reason in ("stop", "length") and not r2.choices[0].message.tool_calls,
                  f"{arch}: the call and the tool's answer go back and are answered (tool_choice none reads no calls)")
            check(r2.usage.prompt_tokens > r.usage.prompt_tokens, f"{arch}: the rendered history carries the call and its result ({r2.usage.prompt_tokens} > {r.usage.prompt_tokens} prompt tokens)")
            r3 = client.chat.completions.create(model="t", messages=user, tools=[WEATHER], max_tokens=12, temperature=0)
            check(r3.choices[0].finish_reason in ("stop", "length", "tool_calls"), f"{arch}: tool_choice auto answers")
        finally:
            code = srv.stop()
        check(code == 0, f"{arch}: the server stopped cleanly")


# Twenty schemas of the shapes clients send, each bounded (lengths, ranges, item counts, enums)
# so that even a random-weight model's answer ends within the token budget.
S = {"type": "string", "maxLength": 10}
SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["n"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["color", "shade"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}]}}, "required": ["v"]},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 6}}, "required": ["maybe"]},
    {"type": "object", "properties": {"kind": {"const": "river"}, "len": {"type": "integer", "minimum": 1, "maximum": 9999}}, "required": ["kind", "len"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "label": S}, "required": ["id", "label"]}, "maxItems": 2}}, "required": ["items"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}}, "required": ["a", "b", "c"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}, "required": ["matrix"]},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "detail": {"type": "string", "maxLength": 12}}, "required": ["status"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]$"}}, "required": ["date"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": S, "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3}}, "required": ["name", "roles"]}}, "required": ["user"]},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": -50, "maximum": 50}, "passed": {"type": "boolean"}}, "required": ["score", "passed"]},
    {"type": "object", "properties": {"steps": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 2}, "done": {"type": "boolean"}}, "required": ["steps", "done"]},
]


def strict(schema):
    """The schema as OpenAI's strict mode has it: no properties beyond those listed, at any depth."""
    if isinstance(schema, list):
        return [strict(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.get("type") == "object":
        out["additionalProperties"] = False
    return out


def structured(client, srv):
    """Constrained decoding (issue 35, item 2): every answer parses and fits its schema."""
    user = [{"role": "user", "content": "Answer in JSON."}]
    for i, schema in enumerate(SCHEMAS):
        for temp in (0.0, 0.9):
            schema_all = strict(schema)
            r = client.chat.completions.create(
                model="tiny", messages=user, max_tokens=300, temperature=temp, seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema_all, "strict": True}},
            )
            text = r.choices[0].message.content
            if r.choices[0].finish_reason != "stop":
                fail(f"schema {i}, temperature {temp}: the answer did not end within 300 tokens: {text!r}")
            try:
                jsonschema.validate(json.loads(text), schema_all)
            except Exception as e:
                fail(f"schema {i}, temperature {temp}: {text!r} does not fit: {e}")
    check(True, f"{len(SCHEMAS)} schemas x 2 temperatures: every answer parses and validates")
    # Streamed: the pieces make the same JSON.
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": strict(SCHEMAS[3])}}
    whole = client.chat.completions.create(model="tiny", messages=user, max_tokens=300, temperature=0, response_format=rf).choices[0].message.content
    parts = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=user, max_tokens=300, temperature=0, response_format=rf, stream=True) if c.choices)
    check(parts == whole and json.loads(parts) is not None, "a streamed constrained answer equals the plain one")
    drafted = client.chat.completions.create(model="tiny", messages=user, max_tokens=300, temperature=0, response_format=rf, extra_body={"ngram": True})
    check(drafted.choices[0].message.content == whole, "with prompt-lookup speculation the constrained answer is the same")
    # json_object: an object from the first byte (a random model's strings may outrun the budget).
    r = client.chat.completions.create(model="tiny", messages=user, max_tokens=40, temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    check(text.startswith("{") and (r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)), f"json_object starts an object ({text[:30]!r}...)")
    # Lark and GBNF grammars (llama-server's `grammar` field), and llama-server's `json_schema`.
    r = client.chat.completions.create(model="tiny", messages=user, max_tokens=20, temperature=0.9, seed=3, extra_body={"grammar": 'start: ("yes" | "no") "." '})
    check(r.choices[0].message.content in ("yes.", "no."), f"a Lark grammar holds ({r.choices[0].message.content!r})")
    for seed in range(4):
        r = client.completions.create(model="tiny", prompt="Pick:", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body={"grammar": 'root ::= ("red" | "blue") "-" [0-9]{2,3} ws\nws ::= [ ]?'})
        text = r.choices[0].text
        if not re.fullmatch(r"(red|blue)-[0-9]{2,3} ?", text):
            fail(f"a GBNF grammar did not hold: {text!r}")
    check(True, "a GBNF grammar holds on /v1/completions (4 seeds)")
    r = client.chat.completions.create(model="tiny", messages=user, max_tokens=300, temperature=0, extra_body={"json_schema": strict(SCHEMAS[1])})
    check("n" in json.loads(r.choices[0].message.content), "llama-server's json_schema field holds")
    for what, extra, param in [
        ("a grammar that does not compile", {"grammar": "start: undefined_rule"}, "grammar"),
        ("a GBNF grammar that does not parse", {"grammar": 'root ::= "a'}, "grammar"),
        ("a schema that does not compile", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
        ("two constraints", {"grammar": 'start: "a"', "json_schema": {}}, "grammar"),
    ]:
        try:
            client.chat.completions.create(model="tiny", messages=user, max_tokens=2, extra_body=extra)
            fail(f"{what}: answered 200")
        except openai.BadRequestError as e:
            check((e.body or {}).get("param") == param, f"{what}: 400 naming {param}")


if __name__ == "__main__":
    main()
