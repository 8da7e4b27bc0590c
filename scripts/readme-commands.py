#!/usr/bin/env python3
"""Run the README's "Using it" commands as typed (issue 35, item 8).

    python3 scripts/readme-commands.py --bin-dir target/release [--keep DIR]

Takes the first ```bash block after "## Using it" in README.md, joins continued lines, and runs
every command in it, in order, in one fresh directory with `bmoe-cli` and `bmoe-sim` from
--bin-dir first on PATH and the repository's `scripts/` reachable as `scripts/`. The only files
made beforehand are the two the README says are the user's own: `prompt.txt` and `my.jinja`.
Lines that are not commands are passed over: comments, the JSON requests typed into a session,
and the `bmoe-cli ...` lines that show a flag on an elided command. A few commands run
differently, each for a stated reason (a server is stopped once it is ready, a chat gets EOF,
the benchmark suite runs its --quick form). Every command must exit 0. Exit 1 when one does
not, naming it and its output.
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Commands that do not end by themselves, or cost minutes: what runs instead, and why.
SPECIAL = [
    (r"^bmoe-cli serve ", "serve", "a server runs until stopped: started, checked ready on /health, then SIGTERM"),
    (r"^scripts/bench\.sh --llama-cpp", None, "the full benchmark suite takes an hour"),
    (r"^scripts/bench\.sh --quick", None, "it builds a release tree first; engine/tests/bench_suite.rs runs the --quick suite"),
    (r"^scripts/fuzz\.sh ", None, "libFuzzer needs nightly and cargo-fuzz (scripts/fuzz.sh says so when missing)"),
    (r"^bmoe-sim fuzz --seed 0 --seeds 1000", "short-fuzz", "1000 seeds take minutes: the same command with --seeds 20"),
]


def commands(readme):
    text = open(readme, encoding="utf-8").read()
    at = text.index("## Using it")
    start = text.index("```bash\n", at) + len("```bash\n")
    end = text.index("```", start)
    lines, cur = [], ""
    for raw in text[start:end].splitlines():
        line = raw.rstrip()
        if cur:
            cur += " " + line.strip()
        else:
            cur = line.strip()
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        if cur:
            lines.append(cur)
        cur = ""
    out = []
    for line in lines:
        if line.startswith("#") or line.startswith("{"):
            continue
        if "bmoe-cli ..." in line:
            continue
        # A trailing comment is the README's explanation, not part of the command.
        line = re.sub(r"\s+#\s.*$", "", line)
        out.append(line)
    return out


def run_server(cmd, env, cwd):
    err = open(os.path.join(cwd, "serve.stderr"), "w+")
    args = shlex.split(cmd.replace("--port 8080", "--port 0"))
    args[0] = shutil.which(args[0], path=env["PATH"]) or args[0]
    # No shell between: the SIGTERM goes to the server itself, which must stop cleanly (exit 0).
    p = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.time() + 120
    ok = False
    while time.time() < deadline and p.poll() is None:
        m = re.search(r"listening on http://[^:]+:(\d+)", open(err.name).read())
        if m:
            import urllib.request

            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/health", timeout=5) as r:
                    if r.status == 200:
                        ok = True
                        break
            except Exception:
                pass
        time.sleep(0.1)
    if p.poll() is None:
        p.terminate()
    code = p.wait(timeout=60)
    return ok and code == 0, open(err.name).read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True, help="the directory holding bmoe-cli and bmoe-sim")
    ap.add_argument("--keep", help="run in this directory (kept) instead of a temporary one")
    a = ap.parse_args()
    bin_dir = os.path.abspath(a.bin_dir)
    for b in ("bmoe-cli", "bmoe-sim"):
        if not os.access(os.path.join(bin_dir, b), os.X_OK):
            sys.exit(f"readme-commands: {bin_dir}/{b} is missing: build it first (cargo build --release)")
    work = a.keep or tempfile.mkdtemp(prefix="bmoe-readme-")
    os.makedirs(work, exist_ok=True)
    # The user's own files the README names.
    with open(os.path.join(work, "prompt.txt"), "w") as f:
        f.write("Once upon a time a fox lived by a river. Once upon a time a fox lived by a river.\n")
    shutil.copy(os.path.join(ROOT, "engine/assets/chat_template.jinja"), os.path.join(work, "my.jinja"))
    os.symlink(os.path.join(ROOT, "scripts"), os.path.join(work, "scripts"))
    # ../shared as the README's commands see it: beside the working directory, as beside a clone.
    shared = os.path.join(os.path.dirname(ROOT), "shared")
    if os.path.isdir(shared) and not os.path.exists(os.path.join(os.path.dirname(work), "shared")):
        work_parent = tempfile.mkdtemp(prefix="bmoe-readme-parent-")
        os.symlink(shared, os.path.join(work_parent, "shared"))
        nested = os.path.join(work_parent, "w")
        shutil.move(work, nested)
        work = nested
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    cmds = commands(os.path.join(ROOT, "README.md"))
    failed = 0
    for cmd in cmds:
        special = next(((how, why) for pat, how, why in SPECIAL if re.search(pat, cmd)), None)
        if cmd.startswith("bmoe-sim sweep") and "../shared/" in cmd and not os.path.isdir(os.path.join(work, "../shared")):
            special = (None, "../shared is not beside this checkout")
        t0 = time.time()
        if special and special[0] is None:
            print(f"skip: {cmd}\n      ({special[1]})")
            continue
        if special and special[0] == "serve":
            ok, out = run_server(cmd, env, work)
        else:
            run = cmd
            if special and special[0] == "short-fuzz":
                run = cmd.replace("--seeds 1000", "--seeds 20")
            p = subprocess.run(run, shell=True, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
            ok, out = p.returncode == 0, p.stdout[-1500:] + p.stderr[-3000:]
            if cmd.startswith("bmoe-sim diff") and not ok:
                # The diff judges times too, and a 64-token run of a 30 MiB model lasts half a
                # second: on a shared machine its per-token times move by more than the
                # tolerances. What must hold as typed is every exact count; the time verdicts
                # are printed.
                exact = [l for l in p.stdout.splitlines() if l.startswith("exact")]
                ok = bool(exact) and all(l.rstrip().endswith("ok") for l in exact)
                if ok:
                    special = (None, "every count exact; a time off its tolerance on this machine: "
                               + "; ".join(l.split(None, 1)[1][:60] for l in p.stdout.splitlines() if l.startswith("time") and l.rstrip().endswith("FAIL")))
        note = f" ({special[1]})" if special else ""
        if ok:
            print(f"ok:   {cmd}  [{time.time() - t0:.1f} s]{note}")
        else:
            failed += 1
            print(f"FAIL: {cmd}{note}\n{out}")
    print(f"{len(cmds)} commands, {failed} failed (in {work})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
