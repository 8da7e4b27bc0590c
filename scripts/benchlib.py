"""Shared helpers of the benchmark scripts that run bmoe-cli under a memory cap (stdlib only).

`bench-stream.py` and `policy-table.py` both need the same two things: drop the page cache before
a run, and run a command inside the cgroup v1 memory limit `CG`. Both need root.
"""
import subprocess

CG = "/sys/fs/cgroup/memory/bmoe-bench"


def drop_caches():
    """Flush dirty pages and drop the page cache, so every run starts cold."""
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def set_limit(limit_gib):
    """Create the cgroup (if needed) and set its memory limit."""
    import os
    os.makedirs(CG, exist_ok=True)
    with open(f"{CG}/memory.limit_in_bytes", "w") as f:
        f.write(str(limit_gib << 30))


def in_cgroup(cmd, peak_rss=False):
    """Run `cmd` cold inside the cgroup; with `peak_rss`, under /usr/bin/time so stderr ends with
    `PEAK_RSS_KIB <n>`. Returns the CompletedProcess (text, captured)."""
    drop_caches()
    runner = "exec /usr/bin/time -f 'PEAK_RSS_KIB %M' \"$@\"" if peak_rss else "exec \"$@\""
    script = f"echo $$ > {CG}/cgroup.procs; {runner}"
    return subprocess.run(["sh", "-c", script, "sh"] + cmd, capture_output=True, text=True)
