#!/usr/bin/env python3
"""The benchmark suite: one command a user runs on their own machine (usually through
scripts/bench.sh, which builds the release binaries first and times the build).

  scripts/bench.sh [--llama-cpp DIR] [--trace ROUTE.csv] [--out DIR] [--models DIR]
                   [-t THREADS] [--reps N] [--full] [--no-cap] [--quick]

What it measures, every cell side by side with llama.cpp in one run, interleaved:

- in RAM: decode (tgN) and prefill (ppP), bmoe-cli (no flags: the experts stay resident)
  against llama.cpp's llama-bench (the faster of its repack settings, per repetition);
- past RAM: the same file under a cgroup v1 memory cap of half its size, page cache dropped
  before every run: bmoe-cli with no flags (it streams the experts by itself) against
  llama-bench on plain mmap (`--repack 0 -lm mmap`; its default repack copies the weights into
  anonymous memory, which the cap kills);
- past RAM on real routing: the same capped cell on a model of the DeepSeek-V2-Lite capture's
  routing shape, driven by the capture (`--routing-from`): its hits, misses and read bytes are
  checked equal to `bmoe-sim replay` of the capture at the same budget, and its tok/s recorded
  against llama.cpp's mmap run of the same file under the same cap.

Each figure stands beside its floor, turned into a ceiling in tok/s: compute = active weight
bytes per token ÷ the memory read bandwidth (`bmoe-cli bench --memory-only`); prefill = active
bytes per token ÷ the kernels' batched rate (`bmoe-cli bench`'s 16-token expert matmul); flash =
the run's own missed bytes per token ÷ raw O_DIRECT bandwidth at its request size and lane
count (`bmoe-cli bench --io-file --io-random`, page cache dropped), the streamed ceiling being
the lower of compute and flash. Streamed cells also carry the simulator's prediction: a
calibration run of the same model under the same cap at another cache budget, fitted by
`bmoe-sim calibrate`, then `bmoe-sim replay` of the cell's routing at the cell's budget.

Each engine runs at -t or at 1 thread, whichever a short decode probe finds faster (llama.cpp's
spinning barrier collapses on a machine with fewer free cores than threads).

Writes OUT/suite.md (the table and every command), OUT/suite.json, OUT/suite.svg and .png
(drawn by `bmoe-sim bars`); each run's CSV and traces stay in OUT/runs/. Progress, with an
ETA, goes to stderr.

Without llama.cpp (`--llama-cpp DIR` holding llama-bench, or llama-bench on PATH) its columns
stay empty with a note. Without root or cgroup v1, the capped cells are skipped with a message.
Without a trace (default: ../shared/traces/deepseek-v2-lite-puffin.route.csv beside the
project), the real-routing cells are skipped with a message. `--quick` is the CI smoke run: the
tiny model, few tokens, streamed cells without a cap; it checks the plumbing, not speed.
"""
import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (Progress, cgroup_argv, cgroup_problem, csv_summary, drop_caches,  # noqa: E402
                      fmt_duration, generation_tps, llama_bench_rows, set_limit_bytes)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.join(os.path.dirname(ROOT), "shared", "traces", "deepseek-v2-lite-puffin.route.csv")
PROMPT = "The expert cache keeps the experts the router asked for, and the streamer reads the rest"
PP_WORDS = ["the", "expert", "cache", "keeps", "routed", "experts", "and", "streams", "the", "rest"]
MIB = 1 << 20
# Its own cgroup, so a suite and another capped benchmark never reset each other's limit.
CG = "/sys/fs/cgroup/memory/bmoe-suite"


class SuiteError(Exception):
    """A failure the user must see, with what was run."""


# ---------------------------------------------------------------------------------------------
# Models


class Model:
    def __init__(self, key, gen, what, in_ram=True, capped=True, routing=False, est_gen_s=30):
        self.key = key
        self.gen = gen
        self.what = what
        self.in_ram = in_ram
        self.capped = capped
        self.routing = routing
        self.est_gen_s = est_gen_s
        self.path = None
        self.info = {}


def models_for(a):
    if a.quick:
        return [Model("tiny", ["--preset", "tiny", "--seed", "1"],
                      "tiny preset (4 layers, 16 experts, top-4; CI smoke model)", est_gen_s=2)]
    ms = [
        Model("small", ["--preset", "small", "--seed", "1"],
              "small preset: qwen3moe, 12 layers, 64 experts top-8, d_model 1024, Q4_K_M", est_gen_s=25),
        # The DeepSeek-V2-Lite capture's routing shape (26 MoE layers, 64 experts, top-6, a
        # shared expert) at half its model width and a third of its expert width, so it generates and streams in minutes; the
        # full shape (~9 GB) is the --full cell. 4 KV heads keep the KV cache of the trace's
        # 804 tokens small beside the cap.
        Model("ds-lite-reduced",
              ["--preset", "deepseek-v2-lite-qwen2moe-stand-in", "--d-model", "1024", "--expert-ffn", "512",
               "--shared-ffn", "1024", "--heads", "16", "--kv-heads", "4", "--head-dim", "64", "--seed", "1"],
              "deepseek-v2-lite-qwen2moe-stand-in reduced: qwen2moe, 26 layers, 64 experts top-6 + "
              "shared, d_model 1024, expert FFN 512, Q4_K_M", in_ram=True, routing=True, est_gen_s=60),
    ]
    if a.full:
        ms.append(Model("ds-lite-full", ["--preset", "deepseek-v2-lite-qwen2moe-stand-in", "--seed", "1"],
                        "deepseek-v2-lite-qwen2moe-stand-in, full size (~9 GB)", in_ram=False, routing=True,
                        est_gen_s=500))
    return ms


# ---------------------------------------------------------------------------------------------
# Running things


class Runner:
    """Runs commands, recording each against the cell it belongs to."""

    def __init__(self, a):
        self.a = a
        self.commands = {}  # cell id -> [command strings]

    def record(self, cell, cmd, note=""):
        text = shlex.join(str(c) for c in cmd)
        self.commands.setdefault(cell, []).append(text + (f"   # {note}" if note else ""))

    def run(self, cell, cmd, note="", check=True, capped=None, watch=None):
        """Run `cmd` (inside the cgroup, page cache dropped first, when `capped`); return the
        CompletedProcess. With `check`, a failure raises SuiteError naming the command. `watch`
        = (metrics CSV, tokens expected): a long run prints how far it got every 15 s."""
        self.record(cell, cmd, note + (" [in the cgroup, page cache dropped first]" if capped else ""))
        cmd = [str(c) for c in cmd]
        if capped:
            drop_caches()
            cmd = cgroup_argv(cmd, cg=CG)
        if watch:
            r = run_watched(cmd, *watch)
        else:
            r = subprocess.run(cmd, capture_output=True, text=True)
        if check and r.returncode != 0:
            tail = (r.stderr or r.stdout or "").strip().splitlines()[-5:]
            killed = " (killed: out of memory under the cap?)" if r.returncode in (137, -9) else ""
            raise SuiteError(f"exit {r.returncode}{killed}: {shlex.join(cmd)}\n    " + "\n    ".join(tail))
        return r


def run_watched(cmd, csv_path, total):
    """subprocess.run(cmd) that prints the metrics CSV's row count every 15 s while it runs."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        t0 = time.monotonic()
        while True:
            try:
                p.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                done = 0
                if os.path.exists(csv_path):
                    with open(csv_path) as f:
                        done = sum(1 for line in f if line[:1].isdigit())
                el = time.monotonic() - t0
                eta = f", about {fmt_duration(el / done * (total - done))} left" if done else ""
                print(f"    {done}/{total} tokens after {fmt_duration(el)}{eta}", file=sys.stderr, flush=True)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, p.returncode, out.read(), err.read())


def pick_threads(r, a, m, notes):
    """Each engine's thread count: -t, or 1 where 1 is faster in a short warm decode probe.
    llama.cpp's threads wait for each other in a spinning barrier, which collapses when the
    machine has fewer free cores than threads (measured here, load 9 on 2 cores: llama-bench
    tg 0.38 tok/s at 2 threads, 7.1 at 1), so one fixed count would judge it by the machine's
    load; bmoe gets the same choice."""
    a.bmoe_t = a.llama_t = a.threads
    if a.threads == 1 or a.quick:
        return
    cell = "machine"
    got = {}
    r.run(cell, [a.cli, "-m", m.path, "-p", "the", "-n", 2, "-t", a.threads], note="warm-up (untimed)")
    for t in (a.threads, 1):
        tps, _, _ = bmoe_rate(r, a, {"id": cell}, [a.cli, "-m", m.path, "-p", "the", "-n", 16, "-t", t],
                              note="thread probe")
        got[("bmoe", t)] = tps
    if a.llama_bench:
        res = r.run(cell, [a.llama_bench, "-m", m.path, "-t", f"1,{a.threads}", "-p", 0, "-n", 8, "-r", 1,
                           "--repack", 0, "-o", "jsonl"], note="thread probe", check=False)
        for _, _, t, tps in llama_bench_rows(res.stdout):
            got[("llama.cpp", t)] = tps
    for eng in ("bmoe", "llama.cpp"):
        many, one = got.get((eng, a.threads)), got.get((eng, 1))
        if many is None or one is None:
            continue
        t = 1 if one > many else a.threads
        if eng == "bmoe":
            a.bmoe_t = t
        else:
            a.llama_t = t
        notes.append(f"{eng} runs at {t} thread(s): a {m.key} decode probe measured {many:.2f} tok/s at "
                     f"{a.threads} threads and {one:.2f} at 1")


def find_llama_bench(arg):
    """(path or None, note)."""
    if arg:
        for cand in [os.path.join(arg, "llama-bench"), os.path.join(arg, "bin", "llama-bench"),
                     os.path.join(arg, "build", "bin", "llama-bench")]:
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand, f"llama.cpp: {cand}"
        raise SystemExit(f"bench-suite: --llama-cpp {arg}: no executable llama-bench in it, "
                         "its bin/ or build/bin/ (build llama.cpp with its llama-bench tool)")
    found = shutil.which("llama-bench")
    if found:
        return found, f"llama.cpp: {found} (found on PATH)"
    return None, ("llama.cpp: not given (--llama-cpp DIR) and no llama-bench on PATH, so its "
                  "columns are empty")


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def spread(xs):
    xs = [x for x in xs if x is not None]
    return (min(xs), max(xs)) if xs else None


# ---------------------------------------------------------------------------------------------
# Machine floors


def memory_bandwidth(r, a):
    out = r.run("machine", [a.cli, "bench", "--memory-only", "-t", a.threads,
                            "--size-mib", 16 if a.quick else 256]).stdout
    # memory: read X GB/s, copy Y GB/s ...
    words = out.split()
    return float(words[words.index("read") + 1])


def kernel_batched_rate(r, a):
    """Bytes per second per token of the kernels' batched product (prefill's compute rate):
    the 864 KiB Q4_K expert matrix over `bmoe-cli bench`'s 16-token matmul time per token."""
    if a.quick:
        return None
    out = r.run("machine", [a.cli, "bench", "-t", a.threads, "--size-mib", 64],
                note="kernels; only the 16-token expert matmul line is used").stdout
    for line in out.splitlines():
        if "16-token matmul" in line:
            us = float(line.split("16-token matmul")[1].split()[0])
            return 768 * 2048 * 144 / 256 / (us * 1e-6)  # Q4_K: 144 bytes per 256 weights
    return None


def odirect_mib_s(r, a, cell, model, kib, lanes):
    """Raw O_DIRECT MiB/s at random request-aligned offsets of the model file, at this request
    size and lane count; page cache dropped first (root) so nothing is served from memory."""
    if a.root and not a.quick:
        drop_caches()
    total = 32 if a.quick else 512
    out = r.run(cell, [a.cli, "bench", "--io-file", model, "--io-random", "--io-seed", int(time.time()),
                       "--io-request-kib", kib, "--io-lanes", lanes, "--io-total-mib", total],
                note="the flash floor's bandwidth").stdout
    for line in out.splitlines():
        if "lanes:" in line:
            return float(line.split("lanes:")[1].split()[0])
    raise SuiteError(f"no bandwidth line in bmoe-cli bench --io-file output:\n{out}")


# ---------------------------------------------------------------------------------------------
# Model facts


def model_facts(r, a, m):
    j = json.loads(r.run("models", [a.cli, "inspect", "--json", m.path]).stdout)
    return j


def active_bytes(j):
    """Weight bytes one decoded token reads: every dense tensor but the token embedding (one
    row of it is read; all of it when the output head is tied to it) plus, per MoE layer, k
    experts."""
    names = {t["name"] for t in j["tensors"]}
    tied = "output.weight" not in names
    dense = 0
    for t in j["tensors"]:
        if "_exps" in t["name"]:
            continue
        if t["name"] == "token_embd.weight" and not tied:
            continue
        dense += t["bytes"]
    routed = sum(l["n_expert_used"] * l["expert_bytes"] for l in j["moe_layers"])
    return dense + routed


# ---------------------------------------------------------------------------------------------
# Cells


def new_cell(cells, cid, model, kind, label, routing="model's own"):
    c = {"id": cid, "model": model.key, "kind": kind, "label": label, "routing": routing,
         "bmoe": [], "llama": [], "ceiling": None, "ceiling_how": "", "sim": None, "notes": []}
    cells.append(c)
    return c


def bmoe_rate(r, a, cell, cmd, capped=False, note="", watch=None):
    res = r.run(cell["id"], cmd, note=note, capped=capped, watch=watch)
    tps = generation_tps(res.stderr)
    if tps is None:
        raise SuiteError(f"no generation: line from {shlex.join(str(c) for c in cmd)}")
    mode = next((l for l in res.stderr.splitlines() if l.startswith("mode:")), "")
    return tps, mode, res


def pp_prompt(r, a, model, cell, target):
    """A prompt bmoe tokenizes to `target` tokens (or the closest found below it): words of a
    fixed sentence, their count corrected from bmoe's own `n_prompt` a few times."""
    words, best, seen = target, None, {}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(6):
            text = " ".join(PP_WORDS[i % len(PP_WORDS)] for i in range(words))
            csv = os.path.join(d, "pp.csv")
            r.run(cell["id"], [a.cli, "-m", model.path, "-p", text, "-n", 1, "-t", a.bmoe_t, "--csv", csv],
                  note="sizing the prompt (untimed)")
            n = int(csv_summary(csv)["n_prompt"])
            seen[words] = n
            if n == target:
                return text, n
            if n < target and (best is None or n > best[1]):
                best = (text, n)
            step = round(words * target / n) - words
            words = max(1, words + (step if step else (1 if n < target else -1)))
            if words in seen:
                break
    return best if best else (text, n)


def in_ram_cells(r, a, m, cells, prog):
    dec = new_cell(cells, f"{m.key}-tg", m, "decode", f"{m.key}\ndecode tg{a.n} in RAM")
    pre = new_cell(cells, f"{m.key}-pp", m, "prefill", f"{m.key}\nprefill pp{a.p} in RAM")
    prog.step(f"{m.key}: in RAM, decode tg{a.n} and prefill pp{a.p}, {a.reps} interleaved repetitions")
    prompt, n_tok = pp_prompt(r, a, m, pre, a.p)
    if n_tok != a.p:
        pre["notes"].append(f"bmoe's prompt is {n_tok} tokens (llama-bench: {a.p})")
    # Warm the page cache: the first run of a file reads it from disk.
    r.run(dec["id"], [a.cli, "-m", m.path, "-p", "the", "-n", 2, "-t", a.bmoe_t], note="warm-up (untimed)")
    modes = set()
    repack_ok = ["0", "1"]
    for rep in range(a.reps):
        tps, mode, _ = bmoe_rate(r, a, dec, [a.cli, "-m", m.path, "-p", "the", "-n", a.n, "-t", a.bmoe_t])
        dec["bmoe"].append(tps)
        modes.add(mode.split(".")[0])
        with tempfile.TemporaryDirectory() as d:
            csv = os.path.join(d, "pp.csv")
            r.run(pre["id"], [a.cli, "-m", m.path, "-p", prompt, "-n", 1, "-t", a.bmoe_t, "--csv", csv],
                  note="timed: n_prompt / prefill_s of the CSV trailer")
            s = csv_summary(csv)
            pre["bmoe"].append(int(s["n_prompt"]) / float(s["prefill_s"]))
        if a.llama_bench:
            best = {}
            for repack in list(repack_ok):
                res = r.run(dec["id"], [a.llama_bench, "-m", m.path, "-t", a.llama_t, "-p", a.p, "-n", a.n,
                                        "-r", 1, "--repack", repack, "-o", "jsonl"],
                            note="both tests; the fastest thread count and repack setting count", check=False)
                if res.returncode != 0:
                    # Not retried in later repetitions; the other setting still counts.
                    repack_ok.remove(repack)
                    dec["notes"].append(f"llama-bench --repack {repack} failed (exit {res.returncode}"
                                        + (", a crash" if res.returncode in (139, -11) else "") + ")")
                    continue
                for test, _, _, tps in llama_bench_rows(res.stdout):
                    best[test] = max(best.get(test, 0.0), tps)
            if f"tg{a.n}" in best:
                dec["llama"].append(best[f"tg{a.n}"])
            if f"pp{a.p}" in best:
                pre["llama"].append(best[f"pp{a.p}"])
        print(f"    rep {rep + 1}: bmoe tg {dec['bmoe'][-1]:.2f} pp {pre['bmoe'][-1]:.1f} tok/s"
              + (f"; llama.cpp tg {dec['llama'][-1]:.2f}" if dec["llama"] else "")
              + (f" pp {pre['llama'][-1]:.1f}" if pre["llama"] else ""),
              file=sys.stderr, flush=True)
    if not any("mode: mmap" in x for x in modes):
        dec["notes"].append("not resident: " + "; ".join(sorted(modes)))
    act = m.info["active_bytes"]
    dec["ceiling"] = a.mem_gbps * 1e9 / act
    dec["ceiling_how"] = f"{act / MIB:.0f} MiB active ÷ {a.mem_gbps:.1f} GB/s memory read"
    if a.batched_rate:
        pre["ceiling"] = a.batched_rate / act
        pre["ceiling_how"] = (f"{act / MIB:.0f} MiB active ÷ {a.batched_rate / 1e9:.1f} GB/s "
                              "(kernels' 16-token matmul)")
    else:
        pre["ceiling_how"] = "not measured (--quick)"


def stream_run(r, a, m, cell, extra, tag, capped, n, prompt="the", trace=True):
    """One streamed bmoe run with a metrics CSV and io trace (and route trace when `trace`).
    Returns (tok/s, mode line, files dict, stderr)."""
    files = {k: os.path.join(a.work, f"{cell['id']}-{tag}.{k}.csv") for k in ("metrics", "io", "route")}
    cmd = [a.cli, "-m", m.path, "-p", prompt, "-n", n, "-t", a.bmoe_t, "-c", a.ctx,
           "--csv", files["metrics"], "--io-trace", files["io"]]
    if trace:
        cmd += ["--route-trace", files["route"]]
    cmd += extra
    tps, mode, res = bmoe_rate(r, a, cell, cmd, capped=capped)
    return tps, mode, files, res.stderr


def mean_request_kib(io_csv):
    """Mean decode read in KiB (phase 1 rows of an io_trace)."""
    import csv
    with open(io_csv) as f:
        rows = [x for x in csv.DictReader(l for l in f if not l.startswith("#")) if x.get("phase") == "1"]
    if not rows:
        return None
    return sum(int(x["req_bytes"]) for x in rows) / len(rows) / 1024


def decode_read_mib_per_token(metrics_csv):
    import csv
    with open(metrics_csv) as f:
        rows = list(csv.DictReader(l for l in f if not l.startswith("#")))
    if not rows:
        return 0.0
    return sum(float(x["read_bytes"]) for x in rows) / len(rows) / MIB


def sim_predict(r, a, cell, profile, route, budget, extra=()):
    """tok/s `bmoe-sim replay` predicts for `route` at `budget` MiB with `profile`."""
    res = r.run(cell["id"], [a.sim, "replay", "--trace", route, "--profile", profile, "--moe-stream",
                             "--cache-mb", budget, "--force-cache", *extra],
                note="the simulator's prediction")
    tps = generation_tps(res.stdout + res.stderr)
    return tps, res.stdout + res.stderr


def sim_line(text):
    for line in text.splitlines():
        if line.startswith("sim:"):
            return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    raise SuiteError(f"no sim: line in bmoe-sim output:\n{text[-2000:]}")


def run_config(metrics_csv):
    """The streaming settings a run resolved (its CSV preamble's `# moe_stream=1 ...` line)."""
    with open(metrics_csv) as f:
        for line in f:
            if line.startswith("# moe_stream="):
                return dict(kv.split("=", 1) for kv in line[2:].split() if "=" in kv)
    raise SuiteError(f"{metrics_csv}: no '# moe_stream=' preamble line")


def same_settings(cfg):
    """Flags that repeat a run's lanes, overlap and read split (the budget is given apart)."""
    flags = ["--io-threads", cfg["io_threads"], "--read-split", cfg["read_split"]]
    if cfg.get("overlap") == "1":
        flags.append("--overlap")
    return flags


def capped_cells(r, a, m, cells, prog, llama_capped):
    size = os.path.getsize(m.path)
    cap = size // 2 if not a.quick else None
    capped = cap is not None
    cid = f"{m.key}-capped"
    label = f"{m.key}\npast RAM" + (f", cap {cap / MIB:.0f} MiB" if capped else " (no cap: --quick)")
    cell = new_cell(cells, cid, m, "streamed", label)
    if capped:
        set_limit_bytes(cap, CG)
        cell["notes"].append(f"cgroup cap {cap / MIB:.0f} MiB = half the {size / MIB:.0f} MiB file")
    # --quick has no cap, so no flags would keep the experts resident: ask for streaming.
    flags = [] if capped else ["--moe-stream", "--cache-mb", "8", "--force-cache"]

    prog.step(f"{m.key}: past RAM, bmoe (no flags) vs llama.cpp mmap, {a.reps} repetitions")
    reads, kibs = [], []
    for rep in range(a.reps):
        tps, mode, files, err = stream_run(r, a, m, cell, flags, f"rep{rep}", capped, a.n_stream,
                                           prompt=PROMPT, trace=False)
        if "expert streaming" not in mode:
            raise SuiteError(f"{m.key}: the capped run did not stream ({mode})")
        cell["bmoe"].append(tps)
        reads.append(decode_read_mib_per_token(files["metrics"]))
        kibs.append(mean_request_kib(files["io"]))
        if rep == 0:
            first = files
        lb = None
        if a.llama_bench:
            res = r.run(cid, [a.llama_bench, "-m", m.path, "-t", a.llama_t, "-p", 0, "-n", a.n_stream, "-r", 1,
                              "--repack", 0, "-lm", "mmap", "-o", "jsonl"], capped=capped, check=False,
                        note="plain mmap: the default repack copies the weights into anonymous memory; "
                             "the faster thread count counts")
            if res.returncode == 0:
                lb = max(tps for *_, tps in llama_bench_rows(res.stdout))
                cell["llama"].append(lb)
            else:
                cell["notes"].append(f"llama-bench failed (exit {res.returncode}"
                                     + (", killed: out of memory" if res.returncode in (137, -9) else "") + ")")
        print(f"    rep {rep + 1}: bmoe {tps:.2f} tok/s ({reads[-1]:.1f} MiB/token read)"
              + (f", llama.cpp mmap {lb:.2f}" if lb else ""), file=sys.stderr, flush=True)
    llama_capped[m.key] = cell["llama"]
    cell["notes"].append(mode.replace("mode: ", ""))
    # The budget, lanes, overlap and read split the engine chose by itself.
    budget = int(round(float(csv_summary(first["metrics"])["cache_budget_MiB"])))
    cfg = run_config(first["metrics"])
    lanes = int(cfg["io_threads"])
    kib = max(4, round((median(kibs) or 1024) / 4) * 4)
    raw = odirect_mib_s(r, a, cid, m.path, kib, lanes)
    mib_tok = median(reads)
    floor_s = max(m.info["active_bytes"] / (a.mem_gbps * 1e9), mib_tok / raw if raw else 0.0)
    cell["ceiling"] = 1.0 / floor_s
    cell["ceiling_how"] = (f"max({m.info['active_bytes'] / MIB:.0f} MiB ÷ {a.mem_gbps:.1f} GB/s, "
                           f"{mib_tok:.1f} MiB missed ÷ {raw:.0f} MiB/s O_DIRECT at {kib} KiB × {lanes} lanes)")
    cell["budget_mib"] = budget

    prog.step(f"{m.key}: past RAM, calibration run and the simulator's prediction")
    # Calibrated on a run at half the cell's budget, same prompt and settings, so the prediction
    # at the cell's own budget is held out; a lossless run routes the same at any budget, so its
    # route trace (not recorded in the timed runs: a traced run is slower) is the cell's routing.
    cal_budget = max(budget // 2, 4)
    _, _, cal_files, _ = stream_run(r, a, m, cell, ["--moe-stream", "--cache-mb", cal_budget, "--force-cache",
                                                    *same_settings(cfg)],
                                    "calibration", capped, a.n_stream, prompt=PROMPT)
    profile = os.path.join(a.work, f"{m.key}.profile.json")
    r.run(cid, [a.sim, "calibrate", "--csv", cal_files["metrics"], "--io-trace", cal_files["io"],
                "--trace", cal_files["route"], "--out", profile], note="fit the device profile")
    pred, text = sim_predict(r, a, cell, profile, cal_files["route"], budget, same_settings(cfg))
    cell["sim"] = pred
    cell["sim_how"] = f"calibrated on a run at {cal_budget} MiB, replayed at the cell's {budget} MiB"
    return budget, profile, cfg


def trace_tokens(path):
    """Tokens (distinct turn, phase, step) of a route trace."""
    import csv
    with open(path) as f:
        return len({(x["turn"], x["phase"], x["step"])
                    for x in csv.DictReader(l for l in f if not l.startswith("#"))})


def routing_cell(r, a, m, cells, prog, budget, profile, cfg, llama_capped):
    size = os.path.getsize(m.path)
    cap = size // 2
    cid = f"{m.key}-real"
    cell = new_cell(cells, cid, m, "streamed", f"{m.key}\npast RAM, real routing", routing=os.path.basename(a.trace))
    prog.step(f"{m.key}: past RAM on real routing ({os.path.basename(a.trace)}), engine vs bmoe-sim replay")
    set_limit_bytes(cap, CG)
    # A one-token prompt: every step routes one token, as the capture's decode steps did; one
    # read split on both sides (the engine's first step is a one-token prefill whose `auto`
    # split differs); the budget, lanes and overlap the engine chose by itself under this cap.
    lanes = int(cfg["io_threads"])
    settings = same_settings(dict(cfg, read_split="lanes"))
    flags = ["--moe-stream", "--cache-mb", budget, "--force-cache", *settings, "--routing-from", a.trace]
    files = {k: os.path.join(a.work, f"{cid}.{k}.csv") for k in ("metrics", "io", "route")}
    n_trace = trace_tokens(a.trace)
    cmd = [a.cli, "-m", m.path, "-p", "The", "-n", n_trace, "-t", a.bmoe_t, "-c", (n_trace + 64) // 64 * 64,
           "--csv", files["metrics"], "--io-trace", files["io"], "--route-trace", files["route"]] + flags
    tps, mode, res = bmoe_rate(r, a, cell, cmd, capped=True, watch=(files["metrics"], n_trace),
                               note="traced (route and io trace): a conservative figure")
    cell["bmoe"].append(tps)
    cell["llama"] = list(llama_capped.get(m.key, []))
    if cell["llama"]:
        cell["notes"].append("llama.cpp: the own-routing cell's mmap runs (same file, same cap; it cannot follow a trace)")
    # The engine's counts.
    import csv
    with open(files["route"]) as f:
        rows = list(csv.DictReader(l for l in f if not l.startswith("#")))
    hits = sum(1 for x in rows if x["residency"] != "0")
    misses = len(rows) - hits
    with open(files["io"]) as f:
        read_bytes = sum(int(x["read_bytes"]) for x in csv.DictReader(l for l in f if not l.startswith("#")))
    s = csv_summary(files["metrics"])
    # The simulator's replay of the capture, re-priced with the engine's layout.
    res = r.run(cid, [a.sim, "replay", "--trace", a.trace, "--layout-from", files["route"], "--profile", profile,
                      "--moe-stream", "--cache-mb", budget, "--force-cache", *settings],
                note="the capture replayed at the same budget: counts must equal the engine's; tok/s = prediction")
    out = res.stdout + res.stderr
    sl = sim_line(out)
    same = (int(sl["hits"]), int(sl["misses"]), int(sl["read_bytes"])) == (hits, misses, read_bytes)
    cell["sim"] = generation_tps(out)
    cell["sim_how"] = f"the capture replayed with the profile calibrated on {m.key}'s own routing"
    cell["counts"] = {"engine": {"hits": hits, "misses": misses, "read_bytes": read_bytes,
                                 "evictions": int(s["evictions"]), "rereads": int(s["rereads"]),
                                 "tokens": int(s["tokens"])},
                      "sim": {k: int(sl[k]) for k in ("hits", "misses", "read_bytes", "evictions", "rereads", "steps")},
                      "equal": same}
    cell["notes"].append(f"{s['tokens']} tokens; hits/misses/read bytes engine {hits}/{misses}/{read_bytes}, "
                         f"bmoe-sim replay {sl['hits']}/{sl['misses']}/{sl['read_bytes']}: "
                         + ("EQUAL" if same else "DIFFERENT"))
    mib_tok = decode_read_mib_per_token(files["metrics"])
    kib = max(4, round((mean_request_kib(files["io"]) or 1024) / 4) * 4)
    raw = odirect_mib_s(r, a, cid, m.path, kib, lanes)
    floor_s = max(m.info["active_bytes"] / (a.mem_gbps * 1e9), mib_tok / raw)
    cell["ceiling"] = 1.0 / floor_s
    cell["ceiling_how"] = (f"max({m.info['active_bytes'] / MIB:.0f} MiB ÷ {a.mem_gbps:.1f} GB/s, "
                           f"{mib_tok:.1f} MiB missed ÷ {raw:.0f} MiB/s O_DIRECT at {kib} KiB × {lanes} lanes)")
    if not same:
        raise SuiteError(f"{cid}: the engine's counts differ from bmoe-sim replay's: {cell['counts']}")


# ---------------------------------------------------------------------------------------------
# Output


def fmt_rate(xs):
    m = median(xs)
    if m is None:
        return "—"
    lo, hi = spread(xs)
    return f"{m:.2f}" + (f" ({lo:.2f}–{hi:.2f})" if len(xs) > 1 else "")


def ratio(x, y):
    return f"{x / y:.2f}" if x and y else "—"


def table(cells):
    head = ("| cell | routing | bmoe tok/s | llama.cpp tok/s | bmoe ÷ llama.cpp | ceiling tok/s (floor) | "
            "bmoe ÷ ceiling | sim predicts tok/s |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for c in cells:
        b, l = median(c["bmoe"]), median(c["llama"])
        rows.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
            c["id"], c["routing"], fmt_rate(c["bmoe"]), fmt_rate(c["llama"]), ratio(b, l),
            f"{c['ceiling']:.2f}" if c["ceiling"] else "—", ratio(b, c["ceiling"]),
            f"{c['sim']:.2f}" if c["sim"] else "—"))
    return head + "\n" + "\n".join(rows)


def write_outputs(a, r, cells, notes, models, started):
    md = [f"# bmoe benchmark suite, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    load = os.getloadavg()
    md.append(f"Machine: {os.cpu_count()} cores; bmoe at {a.bmoe_t} thread(s), llama.cpp at {a.llama_t}; "
              f"load average at the start {a.load_start[0]:.1f}, at the end "
              f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; memory read {a.mem_gbps:.1f} GB/s "
              f"(`bmoe-cli bench --memory-only`). Suite time {fmt_duration(time.monotonic() - started)}"
              + (f" after a {fmt_duration(a.build_seconds)} build" if a.build_seconds is not None else "") + ".")
    md.append("")
    md += [f"- {n}" for n in notes]
    md.append("")
    md.append("Models: " + "; ".join(f"`{m.key}` = {m.what} ({os.path.getsize(m.path) / MIB:.0f} MiB)" for m in models))
    md.append("")
    md.append(table(cells))
    md.append("")
    md.append("Medians of the repetitions, range in brackets. Ceiling = 1 ÷ floor: decode in RAM, "
              "active bytes ÷ memory read bandwidth; prefill, active bytes ÷ the kernels' batched rate; "
              "streamed, the larger of that compute floor and missed bytes ÷ raw O_DIRECT bandwidth.")
    md.append("")
    md.append("| cell | floor | simulator | notes |\n| --- | --- | --- | --- |")
    for c in cells:
        md.append(f"| {c['id']} | {c['ceiling_how'] or '—'} | {c.get('sim_how', '—')} | "
                  f"{'; '.join(c['notes']) or '—'} |")
    md.append("")
    md.append("## Commands")
    for cid in r.commands:
        md.append("")
        md.append(f"`{cid}`:")
        md.append("")
        md.append("```")
        md += r.commands[cid]
        md.append("```")
    with open(os.path.join(a.out, "suite.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.out, "suite.json"), "w") as f:
        json.dump({"cells": cells, "notes": notes, "commands": r.commands, "mem_read_gbps": a.mem_gbps,
                   "threads": {"bmoe": a.bmoe_t, "llama.cpp": a.llama_t}, "build_seconds": a.build_seconds}, f, indent=1)
    chart = {"title": "bmoe benchmark suite: tok/s (log scale)", "y_label": "tok/s", "log_y": True,
             "groups": [{"name": c["label"], "bars": [
                 {"series": "bmoe", "value": median(c["bmoe"])},
                 {"series": "llama.cpp", "value": median(c["llama"])},
                 {"series": "ceiling (floor)", "value": c["ceiling"]},
                 {"series": "simulator", "value": c["sim"]}]} for c in cells]}
    if not cells:
        print("bench-suite: no cell ran, so no plot", file=sys.stderr)
        return
    chart_path = os.path.join(a.work, "chart.json")
    with open(chart_path, "w") as f:
        json.dump(chart, f)
    r.run("plot", [a.sim, "bars", "--json", chart_path, "--out", os.path.join(a.out, "suite")])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp build holding llama-bench (in DIR, DIR/bin or DIR/build/bin)")
    ap.add_argument("--trace", help="the route trace of the real-routing cells (default: ../shared/traces/"
                    "deepseek-v2-lite-puffin.route.csv beside the project, when present)")
    ap.add_argument("--out", default="bench-out", help="where suite.md, suite.json, suite.svg/png go")
    ap.add_argument("--models", default=None, help="where the generated models are kept (default OUT/models)")
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=None, help="repetitions per cell (default 2; --quick 1)")
    ap.add_argument("-n", type=int, default=None, help="decode tokens in RAM (default 64)")
    ap.add_argument("-p", type=int, default=None, help="prefill tokens (default 128)")
    ap.add_argument("--n-stream", type=int, default=None, help="decode tokens past RAM (default 32)")
    ap.add_argument("--only", metavar="MODELS", help="comma-separated model keys to run (small, ds-lite-reduced, ds-lite-full)")
    ap.add_argument("--cells", default="ram,capped,real",
                    help="which cells: ram (in RAM), capped (past RAM), real (past RAM on real routing; needs capped)")
    ap.add_argument("--full", action="store_true", help="also the full DeepSeek-V2-Lite shape (~9 GB) past RAM")
    ap.add_argument("--no-cap", action="store_true", help="skip the capped (past-RAM) cells")
    ap.add_argument("--quick", action="store_true", help="CI smoke run: tiny model, no cap, few tokens")
    ap.add_argument("--build-seconds", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.reps = a.reps or (1 if a.quick else 2)
    a.n = a.n or (8 if a.quick else 64)
    a.p = a.p or (32 if a.quick else 128)
    a.n_stream = a.n_stream or (8 if a.quick else 32)
    a.ctx = 512
    a.cli = os.path.join(a.bin_dir, "bmoe-cli")
    a.sim = os.path.join(a.bin_dir, "bmoe-sim")
    for b in (a.cli, a.sim):
        if not os.access(b, os.X_OK):
            raise SystemExit(f"bench-suite: {b} is missing: build it first (scripts/bench.sh does: "
                             "cargo build --release -p bmoe-engine -p bmoe-sim)")
    os.makedirs(a.out, exist_ok=True)
    a.models = a.models or os.path.join(a.out, "models")
    os.makedirs(a.models, exist_ok=True)
    # Every run's CSV and traces stay here, named after their cell, for a look afterwards.
    a.work = os.path.join(a.out, "runs")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(a.work)
    a.root = os.geteuid() == 0
    notes = []
    a.llama_bench, note = find_llama_bench(a.llama_cpp)
    if a.quick and not a.llama_cpp:
        a.llama_bench, note = None, "llama.cpp: not used by --quick unless --llama-cpp is given"
    notes.append(note)
    why_not = "--no-cap" if a.no_cap else ("--quick runs its streamed cell without a cap" if a.quick else cgroup_problem())
    if why_not and not a.quick:
        notes.append(f"past-RAM cells skipped: {why_not}")
    elif a.quick:
        notes.append("--quick: the streamed cell runs without a cap, so it measures plumbing, not flash")
    trace = a.trace or (DEFAULT_TRACE if os.path.isfile(DEFAULT_TRACE) else None)
    if a.trace and not os.path.isfile(a.trace):
        raise SystemExit(f"bench-suite: --trace {a.trace}: no such file")
    a.trace = os.path.abspath(trace) if trace else None
    if a.quick:
        notes.append("real-routing cells: not in --quick (the tiny model has another routing shape)")
    elif not a.trace:
        notes.append(f"real-routing cells skipped: no route trace (pass --trace PATH; the default {DEFAULT_TRACE} is absent)")
    elif why_not:
        notes.append("real-routing cells skipped: they run past RAM, under the cap")
    else:
        notes.append(f"real routing: {a.trace}")
    capped_ok = a.quick or not why_not
    models = models_for(a)
    if a.only:
        keys = a.only.split(",")
        unknown = [k for k in keys if k not in {m.key for m in models}]
        if unknown:
            raise SystemExit(f"bench-suite: --only {a.only}: no model {unknown[0]!r} in this run "
                             f"(models: {', '.join(m.key for m in models)}; ds-lite-full needs --full)")
        models = [m for m in models if m.key in keys]
    kinds = set(a.cells.split(","))
    if kinds - {"ram", "capped", "real"}:
        raise SystemExit(f"bench-suite: --cells {a.cells}: expected ram, capped and/or real")
    for m in models:
        m.in_ram = m.in_ram and "ram" in kinds
        m.capped = m.capped and bool(kinds & {"capped", "real"})
        m.routing = m.routing and "real" in kinds
    r = Runner(a)
    started = time.monotonic()
    a.load_start = os.getloadavg()

    # The plan, with estimated seconds per step (for the ETA).
    est = [10, 40 if a.llama_bench else 5]
    lb = 1 if a.llama_bench else 0
    for m in models:
        big = m.key == "ds-lite-full"
        est.append(m.est_gen_s if not os.path.exists(os.path.join(a.models, f"{m.key}.gguf")) else 1)
        if m.in_ram:
            est.append(3 if a.quick else a.reps * (m.est_gen_s / 3 + lb * 15) + 10)
        if capped_ok and m.capped:
            est += [3 if a.quick else a.reps * (10 + 20 * lb) * (4 if big else 1) + 15,
                    3 if a.quick else 15 * (4 if big else 1)]
        if capped_ok and m.routing and a.trace and not a.quick:
            est.append(900 if big else 150)
    est.append(5)
    prog = Progress(est)
    cells = []
    failures = []
    prog.step("machine: memory read bandwidth" + ("" if a.quick else " and the kernels' batched rate"))
    a.mem_gbps = memory_bandwidth(r, a)
    a.batched_rate = kernel_batched_rate(r, a)
    print(f"    memory read {a.mem_gbps:.1f} GB/s", file=sys.stderr, flush=True)
    llama_capped = {}
    for m in models:
        m.path = os.path.join(a.models, f"{m.key}.gguf")
        prog.step(f"{m.key}: " + ("generating " if not os.path.exists(m.path) else "found ") + m.path)
        if not os.path.exists(m.path):
            tmp = m.path + ".part"
            r.run("models", [a.cli, "gen", "--quiet", *m.gen, "--out", tmp])
            os.replace(tmp, m.path)
        else:
            r.record("models", [a.cli, "gen", "--quiet", *m.gen, "--out", m.path], note="already present, reused")
        m.info["inspect"] = model_facts(r, a, m)
        m.info["active_bytes"] = active_bytes(m.info["inspect"])
        if m is models[0]:
            prog.step(f"machine: thread counts (a short decode probe of each engine on {m.key})")
            pick_threads(r, a, m, notes)
            print(f"    bmoe -t {a.bmoe_t}, llama.cpp -t {a.llama_t}", file=sys.stderr, flush=True)
        steps = []
        if m.in_ram:
            steps.append(lambda m=m: in_ram_cells(r, a, m, cells, prog))
        for f in steps:
            try:
                f()
            except SuiteError as e:
                failures.append(str(e))
                print(f"    FAILED: {e}", file=sys.stderr, flush=True)
        if capped_ok and m.capped:
            try:
                budget, profile, cfg = capped_cells(r, a, m, cells, prog, llama_capped)
                if m.routing and a.trace and not a.quick:
                    routing_cell(r, a, m, cells, prog, budget, profile, cfg, llama_capped)
            except SuiteError as e:
                failures.append(str(e))
                print(f"    FAILED: {e}", file=sys.stderr, flush=True)
    prog.step("writing the table and the plot")
    for f in failures:
        notes.append(f"FAILED: {f.splitlines()[0]}")
    write_outputs(a, r, cells, notes, models, started)
    print(f"\nbench-suite: wrote {a.out}/suite.md, suite.json, suite.svg, suite.png "
          f"in {fmt_duration(time.monotonic() - started)}\n", file=sys.stderr)
    print(table(cells))
    for n in notes:
        print(f"- {n}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
