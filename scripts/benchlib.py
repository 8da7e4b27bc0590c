"""Shared helpers of the benchmark scripts (stdlib only).

Running under a memory cap (`bench-stream.py`, `policy-table.py`, `bench-capped.py`,
`bench-suite.py`): drop the page cache before a run, and run a command inside the cgroup v1
memory limit `CG` — both need root. Reading results: bmoe-cli's `generation:` line and CSV
`# summary` trailer, llama-bench's JSONL. And `Progress`, the suite's per-step line with an ETA.
"""
import json
import os
import re
import statistics
import subprocess
import sys
import time

CG = "/sys/fs/cgroup/memory/bmoe-bench"

GENERATION = re.compile(r"generation: (\d+) tokens, ([0-9.]+) s/token(?: \(([0-9.]+) tok/s\))?")


def drop_caches():
    """Flush dirty pages and drop the page cache, so every run starts cold."""
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def set_limit(limit_gib, cg=CG):
    """Create the cgroup (if needed) and set its memory limit."""
    set_limit_bytes(limit_gib << 30, cg)


def set_limit_bytes(limit, cg=CG):
    """Create the cgroup (if needed) and set its memory limit in bytes. A limit below what the
    cgroup still holds (page cache charged by earlier runs) is refused by the kernel (EBUSY):
    then the cache is dropped and the group emptied before trying again."""
    import errno
    os.makedirs(cg, exist_ok=True)
    for attempt in range(2):
        try:
            with open(f"{cg}/memory.limit_in_bytes", "w") as f:
                f.write(str(limit))
            return
        except OSError as e:
            if e.errno != errno.EBUSY or attempt:
                raise
            drop_caches()
            with open(f"{cg}/memory.force_empty", "w") as f:
                f.write("0\n")


def cgroup_problem():
    """Why capped runs cannot happen here (a sentence), or None when they can: they need root
    (cgroup, drop_caches) and the cgroup v1 memory controller."""
    if os.geteuid() != 0:
        return "not running as root (the cgroup memory cap and dropping the page cache need root)"
    if not os.path.isdir(os.path.dirname(CG)):
        return (f"no cgroup v1 memory controller at {os.path.dirname(CG)} (a cgroup v2-only "
                "system; these scripts set memory.limit_in_bytes of cgroup v1)")
    return None


def in_cgroup(cmd, peak_rss=False, cg=CG):
    """Run `cmd` cold inside the cgroup; with `peak_rss`, under /usr/bin/time so stderr ends with
    `PEAK_RSS_KIB <n>`. Returns the CompletedProcess (text, captured)."""
    drop_caches()
    return subprocess.run(cgroup_argv(cmd, peak_rss, cg), capture_output=True, text=True)


def cgroup_argv(cmd, peak_rss=False, cg=CG):
    """`cmd` wrapped so that it joins the cgroup before it starts (no cache drop)."""
    runner = "exec /usr/bin/time -f 'PEAK_RSS_KIB %M' \"$@\"" if peak_rss else "exec \"$@\""
    script = f"echo $$ > {cg}/cgroup.procs; {runner}"
    return ["sh", "-c", script, "sh"] + cmd


def generation_tps(stderr):
    """Decode tok/s from bmoe-cli's `generation:` line; None when the run printed none. The
    tok/s figure has more digits than the s/token one."""
    m = GENERATION.search(stderr)
    if not m:
        return None
    return float(m.group(3)) if m.group(3) else 1.0 / float(m.group(2))


def llama_bench_rows(stdout):
    """llama-bench `-o jsonl` output as [(test, repack, threads, tok/s)], test "ppN" or "tgN"."""
    rows = []
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        test = f"pp{j['n_prompt']}" if j["n_gen"] == 0 else f"tg{j['n_gen']}"
        rows.append((test, int(j.get("repack", 0)), int(j.get("n_threads", 0)), float(j["avg_ts"])))
    return rows


def llama_bench_rates(stdout):
    """llama-bench `-o jsonl` output as {"ppN" | "tgN": {repack: tok/s}} (one thread count)."""
    res = {}
    for test, repack, _, tps in llama_bench_rows(stdout):
        res.setdefault(test, {})[repack] = tps
    return res


def csv_summary(path):
    """The last `# summary key=value ...` trailer of a bmoe metrics CSV, as a dict of strings."""
    with open(path) as f:
        trailer = [line for line in f if line.startswith("# summary")]
    if not trailer:
        raise ValueError(f"{path}: no '# summary' trailer (did the run finish?)")
    return dict(x.split("=", 1) for x in trailer[-1].split() if "=" in x)


def fmt_duration(s):
    s = max(0, int(round(s)))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """One line per step: `[i/n] what — elapsed, ETA`. Every step has an estimated cost in
    seconds; the ETA is the estimate of what is left, scaled by how the steps done so far
    compared with their own estimates (so a slow machine's ETA grows after the first steps)."""

    def __init__(self, estimates, out=None):
        self.estimates = list(estimates)
        self.start = time.monotonic()
        self.done_est = 0.0
        self.i = 0
        self.out = out

    def step(self, what):
        """Announce the next step (call once per estimate, in order)."""
        import sys
        elapsed = time.monotonic() - self.start
        left = sum(self.estimates[self.i:])
        scale = elapsed / self.done_est if self.done_est > 30 else 1.0
        eta = left * min(max(scale, 0.3), 5.0)
        n = len(self.estimates)
        line = f"[{self.i + 1}/{n}] {what} — elapsed {fmt_duration(elapsed)}, ETA {fmt_duration(eta)}"
        print(line, file=self.out or sys.stderr, flush=True)
        if self.i < n:
            self.done_est += self.estimates[self.i]
        self.i += 1


def decode_tok_s(csv_path):
    """Decode tok/s of a bmoe run's (or replay's) --csv as the gates compute it: its rows over
    their summed wall_ms."""
    walls = []
    with open(csv_path) as f:
        header = None
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            cells = line.strip().split(",")
            if header is None:
                header = cells
                continue
            walls.append(float(cells[header.index("wall_ms")]))
    return len(walls) / (sum(walls) / 1000.0) if walls and sum(walls) > 0 else 0.0


def mib_per_token(csv_path):
    s = csv_summary(csv_path)
    return float(s.get("read_MiB", 0)) / (float(s.get("tokens", 0)) or 1.0)


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def cpu_name():
    """The CPU's model name (every figure is named with it), or "unknown CPU"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def timed_or_exit(cmd):
    """run_or_exit, and the wall seconds it took (timed from outside the process)."""
    t = time.perf_counter()
    r = run_or_exit(cmd)
    return time.perf_counter() - t, r


def run_or_exit(cmd):
    """Runs cmd; on failure exits naming the command and its last stderr line."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else str(r.returncode)
        sys.exit(f"{' '.join(cmd[:2])}… failed: {tail}")
    return r


def bmoe_binaries(bin_dir):
    """(bmoe-cli, bmoe-sim) in bin_dir; exits saying how to build them when one is missing."""
    cli, sim = os.path.join(bin_dir, "bmoe-cli"), os.path.join(bin_dir, "bmoe-sim")
    for b in (cli, sim):
        if not os.access(b, os.X_OK):
            sys.exit(f"{b} not found: build with `cargo build --release -p bmoe-engine -p bmoe-sim`")
    return cli, sim


def spread(values):
    """(max - min) / median: the run-to-run noise of repeated measurements."""
    return (max(values) - min(values)) / statistics.median(values)
