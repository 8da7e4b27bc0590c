#!/usr/bin/env python3
"""Prices every weight format's kernels per ARM core model with llvm-mca, ours beside ggml's.

For each format and each of decode (one token) and prefill (many tokens), the llvm-mca cycles
per 256 weights (prefill: per 256 weights x token) on llvm-19's Neoverse-N2 and Neoverse-V1
models, for our kernel (at our best level, and at each level) and for llama.cpp's own NEON
kernel of the same format, with the ratio ours / ggml. Writes `mca.md` (the table for
docs/kernels.md) and `mca.json` into the output directory.

  scripts/arm-mca.py [--out DIR] [--formats Q4_K,Q8_0] [--levels neon,dotprod,i8mm]
  scripts/arm-mca.py --check-method        # two toy loops: dynamic trace vs static loop

Method (the same for both sides): a small static aarch64 program runs one kernel call on n
256-weight units per row between two marker functions (ours: engine/examples/kernel_trace.rs
through the crate's public kernel API; ggml: scripts/arm-mca-ggml.c linked with llama.cpp's
ggml-cpu ARM objects built with aarch64-linux-gnu-gcc -O3 -march=armv8.2-a+dotprod+i8mm).
qemu-aarch64-static -singlestep -d exec,nochain logs every executed instruction; the PCs
between the markers, mapped to their text with llvm-objdump, branch and PC-relative targets
rewritten to one local label, are one straight-line trace, priced by llvm-mca -iterations=1.
Two lengths n1 < n2: (cycles(n2) - cycles(n1)) / ((n2 - n1) * rows * tokens) is the cost per
256 weights (x token); the call's fixed costs (checks, prologue, final reduction) cancel.
llvm-mca assumes every load hits L1 and every branch is predicted: this prices the core's
work, not memory. Calls are priced as the branches they are (llvm-mca would give `bl` 100
cycles); the row lengths are chosen per kernel so that the longer trace is about --budget
instructions. Ours: decode is one dot_rows over 8 rows, prefill one matmul of 2 rows x 16
tokens (grouped and wide kernels included), each level capped by BMOE_SIMD.

ggml's kernel is what llama.cpp runs by default on a NEON + dotprod + i8mm core without SVE:
the repacked tiles ggml_repack_get_optimal_repack_type picks (Q8_0, Q4_0 4x8; Q4_K, Q5_K, Q6_K
8x8; IQ4_NL, MXFP4 4x4) as gemv for decode and gemm (4 tokens) for prefill; for the other
formats ggml_vec_dot_<fmt> for decode and, for prefill, its nrc == 2 (i8mm) path where it has
one (Q4_1), else vec_dot per token. The plain vec_dot of the repacked formats is priced too.

ggml's source comes from the llama-cpp-python sdist on PyPI (fetched once through PyPI's JSON
API into ~/.cache/bmoe/arm-mca, checked against its sha256; never into the repository). Tools:
qemu-user-static, gcc/g++-aarch64-linux-gnu, llvm-19, the rust target
aarch64-unknown-linux-musl (scripts/arm.sh installs them).
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLVM = Path("/usr/lib/llvm-19/bin")
TARGET = "aarch64-unknown-linux-musl"
LLAMA_CPP_PYTHON = "0.3.36"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bmoe" / "arm-mca"
GGML_FLAGS = ["-O3", "-march=armv8.2-a+dotprod+i8mm", "-DNDEBUG", "-D_GNU_SOURCE"]
CPUS = ["neoverse-n2", "neoverse-v1"]
CPU_SHORT = {"neoverse-n2": "N2", "neoverse-v1": "V1"}
LEVELS = ["neon", "dotprod", "i8mm"]
MODES = ["decode", "prefill"]
INSTALL = "scripts/arm.sh (or: apt-get install {pkg})"

# Bytes per 256 weights of each format, and of the activation ggml dots it with.
ACT_BYTES = {"f32": 1024, "f16": 512, "bf16": 512, "q8_0": 272, "q8_1": 288, "q8_K": 292}
# format: (weight bytes per 256, ggml activation type, ggml vec_dot, repack tile or None,
#          vec_dot has the nrc == 2 (i8mm) path)
FORMATS = {
    "F32": (1024, "f32", "ggml_vec_dot_f32", None, False),
    "F16": (512, "f16", "ggml_vec_dot_f16", None, False),
    "BF16": (512, "bf16", "ggml_vec_dot_bf16", None, False),
    "Q8_0": (272, "q8_0", "ggml_vec_dot_q8_0_q8_0", "q8_0_4x8_q8_0", True),
    "Q4_0": (144, "q8_0", "ggml_vec_dot_q4_0_q8_0", "q4_0_4x8_q8_0", True),
    "Q4_1": (160, "q8_1", "ggml_vec_dot_q4_1_q8_1", None, True),
    "Q5_0": (176, "q8_0", "ggml_vec_dot_q5_0_q8_0", None, False),
    "Q5_1": (192, "q8_1", "ggml_vec_dot_q5_1_q8_1", None, False),
    "Q2_K": (84, "q8_K", "ggml_vec_dot_q2_K_q8_K", None, False),
    "Q3_K": (110, "q8_K", "ggml_vec_dot_q3_K_q8_K", None, False),
    "Q4_K": (144, "q8_K", "ggml_vec_dot_q4_K_q8_K", "q4_K_8x8_q8_K", True),
    "Q5_K": (176, "q8_K", "ggml_vec_dot_q5_K_q8_K", "q5_K_8x8_q8_K", False),
    "Q6_K": (210, "q8_K", "ggml_vec_dot_q6_K_q8_K", "q6_K_8x8_q8_K", True),
    "IQ4_NL": (144, "q8_0", "ggml_vec_dot_iq4_nl_q8_0", "iq4_nl_4x4_q8_0", False),
    "IQ4_XS": (136, "q8_K", "ggml_vec_dot_iq4_xs_q8_K", None, False),
    "MXFP4": (136, "q8_0", "ggml_vec_dot_mxfp4_q8_0", "mxfp4_4x4_q8_0", False),
}
# Rows and tokens per traced call. Ours: decode one dot_rows over 8 rows (any multi-row
# kernel of up to 8 rows runs whole), prefill a 2-row matmul of 16 tokens (the wide kernels'
# full width; 2 rows for a 2-row smmla tile). ggml: its repacked tiles take 8 rows (a multiple of the 4- and 8-row tiles),
# gemm 4 tokens (llama.cpp calls it on groups of 4 tokens); vec_dot one row and token, its
# nrc == 2 path 2 x 2.
OURS_SHAPE = {"decode": (8, 1), "prefill": (2, 16)}
GGML_SHAPE = {"vec_dot": (1, 1), "vec_dot2": (2, 2), "gemv": (8, 1), "gemm": (8, 4)}


def log(msg):
    print(f"arm-mca: {msg}", file=sys.stderr, flush=True)


def die(msg):
    print(f"arm-mca: error: {msg}", file=sys.stderr)
    sys.exit(1)


def run(cmd, **kw):
    """Runs cmd, failing with its stderr when it fails."""
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        die(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def tool(name, pkg):
    """The path of a tool (a bare name on PATH, or an absolute path), or a clear error."""
    path = name if os.path.isabs(name) else shutil.which(name)
    if not path or not os.access(path, os.X_OK):
        die(f"{name} not found: install it with {INSTALL.format(pkg=pkg)}")
    return path


class Tools:
    def __init__(self, need_ggml=True, need_cargo=True):
        self.qemu = tool("qemu-aarch64-static", "qemu-user-static")
        self.mca = tool(str(LLVM / "llvm-mca"), "llvm-19")
        self.objdump = tool(str(LLVM / "llvm-objdump"), "llvm-19")
        self.nm = tool(str(LLVM / "llvm-nm"), "llvm-19")
        self.strip = tool("aarch64-linux-gnu-strip", "binutils-aarch64-linux-gnu")
        self.symbolizer = tool(str(LLVM / "llvm-symbolizer"), "llvm-19")
        self.gcc = tool("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu")
        if need_ggml:
            self.gxx = tool("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu")
        if need_cargo:
            self.cargo = tool("cargo", "cargo (rustup)")
            rustup = shutil.which("rustup")
            if rustup:
                installed = run([rustup, "target", "list", "--installed"]).split()
                if TARGET not in installed:
                    die(f"rust target {TARGET} missing: scripts/arm.sh (or: rustup target add {TARGET})")


# ---------------------------------------------------------------- ggml: source and harness


def llama_source(explicit):
    """The llama.cpp tree (the directory holding ggml/) of the pinned llama-cpp-python sdist."""
    if explicit:
        src = Path(explicit)
        if not (src / "ggml/src/ggml-cpu/arch/arm/quants.c").exists():
            die(f"{src} has no ggml/src/ggml-cpu/arch/arm/quants.c (give the vendor/llama.cpp dir)")
        return src
    dest = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    src = dest / "vendor" / "llama.cpp"
    if (src / "ggml/src/ggml-cpu/arch/arm/quants.c").exists():
        return src
    log(f"fetching llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist from PyPI")
    # The project's JSON (the per-version one is not served by every mirror); its file URLs
    # may be relative to it.
    url = "https://pypi.org/pypi/llama-cpp-python/json"
    with urllib.request.urlopen(url, timeout=60) as r:
        meta = json.load(r)
    files = meta.get("releases", {}).get(LLAMA_CPP_PYTHON, [])
    sdists = [dict(u, url=urllib.parse.urljoin(url, u["url"])) for u in files if u["packagetype"] == "sdist"]
    if not sdists:
        die(f"PyPI lists no sdist for llama-cpp-python {LLAMA_CPP_PYTHON}")
    sdist = sdists[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    tarball = CACHE / sdist["filename"]
    if not tarball.exists() or sha256(tarball) != sdist["digests"]["sha256"]:
        part = tarball.with_suffix(".part")
        with urllib.request.urlopen(sdist["url"], timeout=600) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f)
        if sha256(part) != sdist["digests"]["sha256"]:
            die(f"{sdist['url']}: sha256 differs from PyPI's")
        part.rename(tarball)
    with tarfile.open(tarball) as tar:
        top = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/ggml/"
        members = [m for m in tar.getmembers() if m.name.startswith(top)]
        tar.extractall(CACHE, members=members, filter="data")
    if not (src / "ggml/src/ggml-cpu/arch/arm/quants.c").exists():
        die(f"{tarball} has no {top}src/ggml-cpu/arch/arm/quants.c")
    tarball.unlink()  # the unpacked ggml/ is all that is used (25 of the sdist's 75 MB)
    return src


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_ggml(tools, src):
    """The static ggml harness (cached by source tree, harness text and flags)."""
    harness = ROOT / "scripts" / "arm-mca-ggml.c"
    key = hashlib.sha256(
        (str(src.resolve()) + harness.read_text() + " ".join(GGML_FLAGS)).encode()
    ).hexdigest()[:16]
    out = CACHE / f"ggml-{LLAMA_CPP_PYTHON}-{key}"
    exe = out / "ggml_trace"
    if exe.exists():
        return exe
    for stale in CACHE.glob(f"ggml-{LLAMA_CPP_PYTHON}-*"):
        shutil.rmtree(stale, ignore_errors=True)  # built from another harness or tree
    log(f"building ggml's ARM kernels and the harness in {out}")
    out.mkdir(parents=True, exist_ok=True)
    ggml = src / "ggml"
    inc = [f"-I{ggml / d}" for d in ("include", "src", "src/ggml-cpu")]
    cpu = ggml / "src" / "ggml-cpu"
    objs = []
    for source, compiler in (
        (cpu / "arch/arm/quants.c", tools.gcc),
        (cpu / "arch/arm/repack.cpp", tools.gxx),
        (cpu / "vec.cpp", tools.gxx),
    ):
        obj = out / (source.stem + ".o")
        run([compiler, *GGML_FLAGS, *inc, "-c", str(source), "-o", str(obj)])
        objs.append(obj)
    main = out / "harness.o"
    run([tools.gcc, "-O2", "-c", str(harness), "-o", str(main)])
    objs.append(main)
    # The generic fallbacks and tables these objects name but the priced kernels never reach
    # (they live in ggml-cpu.c / ggml-quants.c, which we do not build): stubs that abort.
    defined, undefined = set(), set()
    for line in run([tools.nm, *map(str, objs)]).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRW":
            defined.add(parts[2])
    stubs = sorted(s for s in undefined - defined if s.startswith(("ggml_", "quantize_")))
    stub_c = out / "stubs.c"
    stub_c.write_text("#include <stdlib.h>\n" + "".join(f"void {s}(void) {{ abort(); }}\n" for s in stubs))
    run([tools.gcc, "-O2", "-c", str(stub_c), "-o", str(out / "stubs.o")])
    objs.append(out / "stubs.o")
    run([tools.gxx, "-static", "-o", str(exe), *map(str, objs), "-lm"])
    return exe


def build_ours(tools, skip):
    exe = ROOT / "target" / TARGET / "release" / "examples" / "kernel_trace"
    if not skip:
        log(f"building engine/examples/kernel_trace.rs for {TARGET} (cargo, release)")
        p = subprocess.run(
            [tools.cargo, "build", "--release", "--target", TARGET, "-p", "bmoe-engine",
             "--example", "kernel_trace"],
            cwd=ROOT, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            die(f"cargo build of kernel_trace failed:\n{p.stderr[-3000:]}")
    if not exe.exists():
        die(f"{exe} missing (build it or drop --no-build)")
    return exe


# ---------------------------------------------------------------- traces


class Binary:
    """An aarch64 binary's instructions by address, its markers, and a stripped copy to run
    (qemu then logs no symbol names, which keeps the logs small)."""

    INSN = re.compile(r"^\s*([0-9a-f]+):\s+(.*)$")

    def __init__(self, tools, path, work):
        self.tools, self.path = tools, path
        self.insns = {}
        for line in run([tools.objdump, "-d", "--no-show-raw-insn", str(path)]).splitlines():
            m = self.INSN.match(line)
            if m:
                self.insns[int(m.group(1), 16)] = m.group(2)
        syms = {}
        for line in run([tools.nm, "-S", "--defined-only", str(path)]).splitlines():
            parts = line.split()
            if len(parts) == 4:
                syms[parts[3]] = (int(parts[0], 16), int(parts[1], 16))
        for marker in ("bmoe_trace_begin", "bmoe_trace_end"):
            if marker not in syms:
                die(f"{path} has no {marker} symbol")
        self.begin, self.begin_size = syms["bmoe_trace_begin"]
        self.end = syms["bmoe_trace_end"][0]
        self.run_copy = Path(work) / (path.name + ".stripped")
        run([tools.strip, "-o", str(self.run_copy), str(path)])
        self._lines = {}

    def trace(self, args, env=None):
        """The PCs executed between the markers by one run of the binary with `args`."""
        with tempfile.TemporaryDirectory() as tmp:
            logfile = Path(tmp) / "exec.log"
            cmd = [self.tools.qemu, "-cpu", "max", "-singlestep", "-d", "exec,nochain",
                   "-D", str(logfile), str(self.run_copy), *map(str, args)]
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
            if p.returncode != 0:
                die(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
            pcs, state = [], 0
            pat = re.compile(rb"^Trace \d+: 0x[0-9a-f]+ \[[0-9a-f]+/([0-9a-f]+)/")
            with open(logfile, "rb") as f:
                for line in f:
                    m = pat.match(line)
                    if not m:
                        continue
                    pc = int(m.group(1), 16)
                    if state == 0:
                        if pc == self.begin:
                            state = 1
                    elif state == 1:
                        if not self.begin <= pc < self.begin + self.begin_size:
                            state = 2
                            pcs.append(pc)
                    elif pc == self.end:
                        return pcs
                    else:
                        pcs.append(pc)
        die(f"{self.path} {' '.join(map(str, args))}: the trace never reached bmoe_trace_end")

    def source_files(self, pcs):
        """Share of `pcs` per (source file, function) of the innermost inlined frame in our
        own source (engine/src/), from the line tables; '-' where there is none (ggml's
        objects carry no line tables)."""
        counts = {}
        for pc in pcs:
            counts[pc] = counts.get(pc, 0) + 1
        uniq = sorted(counts)
        p = subprocess.run([self.tools.symbolizer, "--obj", str(self.path), "--output-style=JSON",
                            "--inlining=true"],
                           input="".join(f"0x{pc:x}\n" for pc in uniq), capture_output=True, text=True)
        places = {}
        for pc, line in zip(uniq, p.stdout.splitlines()):
            place = "-"
            try:
                frames = json.loads(line).get("Symbol", [])
            except ValueError:
                frames = []
            for frame in frames:
                file = frame.get("FileName", "")
                if "/engine/src/" in file:
                    place = f"{file.split('/engine/src/', 1)[1]} {demangle(frame.get('FunctionName', ''))}"
                    break
            places[place] = places.get(place, 0) + counts[pc]
        total = sum(places.values()) or 1
        return sorted(((f, n / total) for f, n in places.items()), key=lambda x: -x[1])

    def assembly(self, pcs):
        """The trace as llvm-mca input: one instruction a line, every PC-relative target (a
        branch's, adr/adrp's, a literal load's) the one local label `.Lt`."""
        out = [".text", ".Lt:"]
        for pc in pcs:
            text = self._lines.get(pc)
            if text is None:
                text = self._lines[pc] = assemblable(self.insns.get(pc), pc, self.path)
            if text:
                out.append(text)
        return "\n".join(out) + "\n"


def demangle(name):
    """A legacy-mangled Rust path, short: its last two components, no hash."""
    name = re.sub(r"::h[0-9a-f]{16}$", "", name)
    for a, b in (("$LT$", "<"), ("$GT$", ">"), ("$u20$", " "), ("$u7b$", "{"), ("$u7d$", "}"),
                 ("$C$", ","), ("$RF$", "&"), ("..", "::")):
        name = name.replace(a, b)
    name = name.replace("bmoe_engine::kernels::", "")
    return name if len(name) < 60 else name[:57] + "..."


HEX_OPERAND = re.compile(r"(,\s*|\s+)0x[0-9a-f]+$")


def assemblable(text, pc, path):
    if text is None:
        die(f"{path}: executed address 0x{pc:x} is not in the disassembly")
    text = text.split("<", 1)[0].split("//", 1)[0].strip()
    if not text or text.startswith((".word", "udf")) or "unknown" in text:
        die(f"{path}: executed 0x{pc:x} is not an instruction: {text!r}")
    # llvm-objdump prints a PC-relative operand as a bare address (immediates carry '#').
    text = HEX_OPERAND.sub(lambda m: m.group(1) + ".Lt", text)
    # A call as the plain branch it is to the core (llvm-mca would give it 100 cycles of
    # latency, holding retirement behind it); the return is a branch already.
    mnemonic, _, operands = text.partition("\t") if "\t" in text else text.partition(" ")
    if mnemonic == "bl":
        return "b\t" + operands
    if mnemonic == "blr":
        return "br\t" + operands
    return text


class Mca:
    """llvm-mca total cycles of a straight-line trace, per core model, memoised by content."""

    def __init__(self, tools):
        self.tools = tools
        self.memo = {}

    def cycles(self, asm, cpu):
        key = (hashlib.sha256(asm.encode()).hexdigest(), cpu)
        if key not in self.memo:
            with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
                f.write(asm)
            try:
                p = subprocess.run(
                    [self.tools.mca, "-mtriple=aarch64", f"-mcpu={cpu}", "-mattr=+dotprod,+i8mm",
                     "-iterations=1", "-skip-unsupported-instructions=lack-sched", "-summary-view", "-instruction-info=false",
                     "-resource-pressure=false", f.name],
                    capture_output=True, text=True)
            finally:
                os.unlink(f.name)
            m = re.search(r"Total Cycles:\s+(\d+)", p.stdout)
            if p.returncode != 0 or not m:
                die(f"llvm-mca -mcpu={cpu} failed on a trace:\n{p.stderr[-2000:]}")
            # Instructions the model has no scheduling data for are left out (and named).
            skipped = re.findall(r"note: instruction:\s*(.*)", p.stderr)
            self.memo[key] = (int(m.group(1)), skipped)
        return self.memo[key]


class Kernel:
    """One kernel call of one harness (`args_of(n)`: its arguments for rows of n 256-weight
    units; `per_unit`: rows x tokens of one call), traced at any length on demand."""

    def __init__(self, binary, args_of, per_unit, env=None):
        self.binary, self.args_of, self.per_unit, self.env = binary, args_of, per_unit, env
        self.traces = {}

    def trace(self, n):
        if n not in self.traces:
            self.traces[n] = self.binary.trace(self.args_of(n), self.env)
        return self.traces[n]

    def sizes(self, budget, n_max):
        """(n1, n2): the longer trace about `budget` instructions (at most n_max units, at
        least 2), the shorter a third of it, so that the difference spans as many units as the
        budget allows (llvm-mca's run time grows with the trace)."""
        t1, t2 = len(self.trace(1)), len(self.trace(2))
        unit = max(1, t2 - t1)
        n2 = int(max(2, min(n_max, (budget - max(0, t1 - unit)) // unit)))
        return max(1, n2 // 3), n2

    def delta(self, n1, n2):
        """The instructions the longer call executes beyond the shorter, by address."""
        c1, c2 = {}, {}
        for counts, n in ((c1, n1), (c2, n2)):
            for pc in self.trace(n):
                counts[pc] = counts.get(pc, 0) + 1
        return {pc: c2.get(pc, 0) - c1.get(pc, 0) for pc in set(c1) | set(c2) if c2.get(pc, 0) != c1.get(pc, 0)}

    def price(self, mca, n1, n2):
        """Cycles and instructions per 256 weights (x token) on each CPU: the two traces'
        difference over the extra 256-weight units times rows x tokens."""
        traces = {n: self.trace(n) for n in (n1, n2)}
        asm = {n: self.binary.assembly(t) for n, t in traces.items()}
        units = (n2 - n1) * self.per_unit
        result = {
            "n1": n1, "n2": n2,
            "instructions_per_256": (len(traces[n2]) - len(traces[n1])) / units,
            "trace_instructions": {str(n): len(t) for n, t in traces.items()},
            "cycles_total": {},
            "cycles_per_256": {},
        }
        # The four llvm-mca runs two at a time (each is one single-threaded process).
        with ThreadPoolExecutor(max_workers=2) as pool:
            jobs = {(cpu, n): pool.submit(mca.cycles, asm[n], cpu) for cpu in CPUS for n in (n1, n2)}
        for cpu in CPUS:
            c = {n: jobs[cpu, n].result()[0] for n in (n1, n2)}
            result["cycles_total"][cpu] = {str(n): v for n, v in c.items()}
            result["cycles_per_256"][cpu] = (c[n2] - c[n1]) / units
            skipped = {n: jobs[cpu, n].result()[1] for n in (n1, n2)}
            if skipped[n2]:
                result.setdefault("skipped_by_mca", {})[cpu] = sorted(set(skipped[n2]))
            if len(skipped[n2]) != len(skipped[n1]):
                log(f"warning: llvm-mca -mcpu={cpu} has no scheduling data for instructions in "
                    f"the loop ({', '.join(sorted(set(skipped[n2])))}): left out, so the cycles are low")
        return result


def ggml_kernels(fmt, mode):
    """(kind, function) ggml runs for `fmt` in `mode` by default on a dotprod + i8mm core
    without SVE, and the alternative worth showing (or None)."""
    _, _, vec_dot, tile, nrc2 = FORMATS[fmt]
    plain = ("vec_dot2", vec_dot) if (mode == "prefill" and nrc2) else ("vec_dot", vec_dot)
    if tile:
        repacked = ("gemv" if mode == "decode" else "gemm", f"ggml_{'gemv' if mode == 'decode' else 'gemm'}_{tile}")
        return repacked, plain
    return plain, None


def describe_ggml(kind, function, mode):
    if kind == "vec_dot":
        return function + (" per token" if mode == "prefill" else "")
    return function + {"vec_dot2": " nrc=2 (i8mm)", "gemv": " (repacked)", "gemm": " (repacked)"}[kind]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "out" / "arm-mca"),
                    help="directory for mca.md and mca.json (default: out/arm-mca, gitignored)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated (default: all)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--levels", default=",".join(LEVELS),
                    help="our levels to price (BMOE_SIMD caps; the best one is the last)")
    ap.add_argument("--budget", type=int, default=60000,
                    help="instructions in the longer trace (sets the row lengths; default 60000)")
    ap.add_argument("--n-max", type=int, default=24, help="longest row, in 256-weight units")
    ap.add_argument("--llama-src", help="an unpacked vendor/llama.cpp dir (default: fetch the sdist)")
    ap.add_argument("--no-build", action="store_true", help="use the kernel_trace binary as built")
    ap.add_argument("--no-ggml-alt", action="store_true",
                    help="skip ggml's non-default kernel (vec_dot beside a repacked gemv/gemm)")
    ap.add_argument("--check-method", action="store_true",
                    help="price two toy loops both by the dynamic trace and by static loop extraction")
    a = ap.parse_args()

    if a.check_method:
        return check_method()
    formats = [f.strip().upper() for f in a.formats.split(",") if f.strip()]
    for f in formats:
        if f not in FORMATS:
            die(f"unknown format {f} (known: {', '.join(FORMATS)})")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    levels = [l.strip() for l in a.levels.split(",") if l.strip()]
    if any(m not in MODES for m in modes) or any(l not in LEVELS for l in levels) or not levels:
        die(f"modes are {MODES}, levels {LEVELS}")
    if a.n_max < 2 or a.budget < 1000:
        die("need --n-max >= 2 and --budget >= 1000")

    tools = Tools()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    src = llama_source(a.llama_src)
    ggml_exe = build_ggml(tools, src)
    ours_exe = build_ours(tools, a.no_build)
    work = tempfile.mkdtemp(prefix="arm-mca-")
    try:
        log("disassembling both harnesses")
        ggml_bin, ours_bin = Binary(tools, ggml_exe, work), Binary(tools, ours_exe, work)
        mca = Mca(tools)
        rows = []
        started = time.time()
        for fmt in formats:
            wbytes, act, _, _, _ = FORMATS[fmt]
            for mode in modes:
                row = {"format": fmt, "mode": mode, "ours": {}, "ggml": {}}
                r, t = OURS_SHAPE[mode]
                # The best level first; a lower level whose longer call executes exactly the
                # same extra instructions runs the same kernel code, and takes its numbers.
                priced = []
                for level in reversed(levels):
                    k = Kernel(ours_bin, lambda n: [fmt, mode, n, r, t], r * t, {"BMOE_SIMD": level})
                    if not priced:
                        n1, n2 = k.sizes(a.budget, a.n_max)
                    delta = k.delta(n1, n2)
                    same = next((lv for lv, d in priced if d == delta), None)
                    if same:
                        log(f"{fmt} {mode}: ours at {level} runs the same code as at {same}")
                        res = dict(row["ours"][same], same_code_as=same)
                    else:
                        log(f"{fmt} {mode}: ours at {level}, n = {n1} and {n2} ({time.time() - started:.0f} s)")
                        res = k.price(mca, n1, n2)
                        res["rows"], res["tokens"] = r, t
                        res["source"] = [[f, round(sh, 3)] for f, sh in ours_bin.source_files(k.trace(n2))
                                         if sh >= 0.01]
                    priced.append((level, delta))
                    row["ours"][level] = res
                row["ours"] = {level: row["ours"][level] for level in levels}
                default, alt = ggml_kernels(fmt, mode)
                for which, kernel in (("default", default), ("alt", alt)):
                    if kernel is None or (which == "alt" and a.no_ggml_alt):
                        continue
                    kind, function = kernel
                    gr, gt = GGML_SHAPE[kind]
                    k = Kernel(ggml_bin, lambda n: [kind, function, n, gr, gt, wbytes, ACT_BYTES[act]], gr * gt)
                    g1, g2 = k.sizes(a.budget, a.n_max)
                    log(f"{fmt} {mode}: ggml {function} ({kind}), n = {g1} and {g2}")
                    res = k.price(mca, g1, g2)
                    res.update(kind=kind, function=function, rows=gr, tokens=gt,
                               kernel=describe_ggml(kind, function, mode))
                    row["ggml"][which] = res
                rows.append(row)
        best = levels[-1]
        doc = {
            "method": "dynamic trace (qemu -singlestep -d exec,nochain) priced by llvm-mca "
                      "-iterations=1 at two row lengths; (cycles(n2)-cycles(n1))/((n2-n1)*rows*tokens)",
            "llvm_mca": llvm_version(tools),
            "cpus": CPUS,
            "budget_instructions": a.budget,
            "ggml": {"source": f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist, vendor/llama.cpp/ggml",
                     "compiler": " ".join([Path(tools.gcc).name, *GGML_FLAGS])},
            "ours": {"binary": "engine/examples/kernel_trace.rs", "target": TARGET,
                     "commit": git_head(), "best_level": best},
            "rows": rows,
        }
        (out / "mca.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / "mca.md").write_text(markdown(doc, levels))
        log(f"wrote {out / 'mca.md'} and {out / 'mca.json'} ({time.time() - started:.0f} s)")
        print((out / "mca.md").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def llvm_version(tools):
    m = re.search(r"LLVM version ([\w.]+)", run([tools.mca, "--version"]))
    return f"llvm-mca {m.group(1)}" if m else "llvm-mca"


def git_head():
    p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return p.stdout.strip() + ("+dirty" if dirty else "")


def our_kernel(res, level):
    """The level and the source files the traced instructions came from, largest share first."""
    files = {}
    for place, share in res["source"]:
        file = place.split(" ", 1)[0]
        files[file] = files.get(file, 0) + share
    top = sorted(files.items(), key=lambda x: -x[1])[:2]
    return f"{level}: " + ", ".join(f"{f} {share:.0%}" for f, share in top)


def markdown(doc, levels):
    best = doc["ours"]["best_level"]
    lines = [
        f"llvm-mca cycles per 256 weights (prefill: per 256 weights x token), ours at `{best}` "
        f"(commit {doc['ours']['commit']}) against ggml (llama-cpp-python {LLAMA_CPP_PYTHON}, "
        f"{doc['ggml']['compiler']}); ratio = ours / ggml.",
        "",
        "| format | mode | N2 ours | N2 ggml | N2 ratio | V1 ours | V1 ggml | V1 ratio | ggml kernel | our kernel (source of the hot instructions) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for row in doc["rows"]:
        ours, ggml = row["ours"][best], row["ggml"]["default"]
        cells = [row["format"], row["mode"]]
        for cpu in CPUS:
            o, g = ours["cycles_per_256"][cpu], ggml["cycles_per_256"][cpu]
            cells += [f"{o:.1f}", f"{g:.1f}", f"{o / g:.2f}x" if g > 0 else "-"]
        cells += [f"`{ggml['kernel']}`", our_kernel(ours, best)]
        lines.append("| " + " | ".join(cells) + " |")
    if len(levels) > 1:
        lines += ["", "Ours per level (cycles per 256 weights, N2 / V1):", "",
                  "| format | mode | " + " | ".join(levels) + " |",
                  "| --- | --- | " + " | ".join("---:" for _ in levels) + " |"]
        for row in doc["rows"]:
            cells = [row["format"], row["mode"]]
            for level in levels:
                c = row["ours"][level]["cycles_per_256"]
                cells.append(" / ".join(f"{c[cpu]:.1f}" for cpu in CPUS))
            lines.append("| " + " | ".join(cells) + " |")
    alts = [r for r in doc["rows"] if "alt" in r["ggml"]]
    if alts:
        lines += ["", "ggml's other kernel for the repacked formats (cycles per 256 weights, N2 / V1):", "",
                  "| format | mode | default | cycles | other | cycles |", "| --- | --- | --- | ---: | --- | ---: |"]
        for row in alts:
            d, o = row["ggml"]["default"], row["ggml"]["alt"]
            fmt = lambda r: " / ".join(f"{r['cycles_per_256'][cpu]:.1f}" for cpu in CPUS)
            lines.append(f"| {row['format']} | {row['mode']} | `{d['kernel']}` | {fmt(d)} | `{o['kernel']}` | {fmt(o)} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the method's own check

TOY = r"""
#include <arm_neon.h>
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) void bmoe_trace_begin(void) { __asm__ volatile("nop"); }
__attribute__((noinline)) void bmoe_trace_end(void) { __asm__ volatile("nop\n\tnop"); }
/* Latency-bound: two scalar fused multiply-add chains, two elements an iteration, so an
   iteration costs one FMA latency (4 cycles on both cores). */
__attribute__((noinline)) float toy_chain(const float *a, const float *b, int n) {
    float s0 = 0, s1 = 0;
    for (int i = 0; i < n; i += 2) { s0 += a[i] * b[i]; s1 += a[i + 1] * b[i + 1]; }
    return s0 + s1;
}
/* Throughput-bound: eight vector FMA chains, 32 elements an iteration (16 loads, 8 FMAs). */
#define FMA(k) s##k = vfmaq_f32(s##k, vld1q_f32(a + i + 4 * k), vld1q_f32(b + i + 4 * k))
__attribute__((noinline)) float toy_wide(const float *a, const float *b, int n) {
    float32x4_t s0 = vdupq_n_f32(0), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int i = 0; i < n; i += 32) { FMA(0); FMA(1); FMA(2); FMA(3); FMA(4); FMA(5); FMA(6); FMA(7); }
    s0 = vaddq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)), vaddq_f32(vaddq_f32(s4, s5), vaddq_f32(s6, s7)));
    return vaddvq_f32(s0);
}
int main(int argc, char **argv) {
    int wide = argv[1][0] == 'w', n = atoi(argv[2]);
    float *a = malloc(4 * n), *b = malloc(4 * n);
    for (int i = 0; i < n; i++) { a[i] = i; b[i] = 1; }
    bmoe_trace_begin();
    volatile float r = wide ? toy_wide(a, b, n) : toy_chain(a, b, n);
    bmoe_trace_end();
    printf("%f\n", (double)r);
    return 0;
}
"""


def check_method():
    """Two toy loops priced both ways: the dynamic trace's cycles per iteration against the
    static loop body's (branch target to backward branch, llvm-mca -iterations=1000)."""
    tools = Tools(need_ggml=False, need_cargo=False)
    mca = Mca(tools)
    with tempfile.TemporaryDirectory() as work:
        src, exe = Path(work) / "toy.c", Path(work) / "toy"
        src.write_text(TOY)
        run([tools.gcc, "-O2", "-static", str(src), "-o", str(exe)])
        binary = Binary(tools, exe, work)
        for toy, per_iteration in (("toy_chain", 2), ("toy_wide", 32)):
            dis = run([tools.objdump, "-d", "--no-show-raw-insn", f"--disassemble-symbols={toy}", str(exe)])
            insns = [(int(m.group(1), 16), m.group(2)) for m in map(Binary.INSN.match, dis.splitlines()) if m]
            body = []
            for pc, text in insns:
                m = re.match(r"(?:b\.\w+|cbn?z\s+\w+,)\s+0x([0-9a-f]+)", text)
                if m and int(m.group(1), 16) < pc:
                    target = int(m.group(1), 16)
                    body = [assemblable(t, p, exe) for p, t in insns if target <= p <= pc]
            if not body:
                die(f"{toy}: no backward branch found")
            static_asm = ".text\n.Lt:\n" + "\n".join(body) + "\n"
            n1, n2 = 64 * per_iteration, 320 * per_iteration
            asm = {n: binary.assembly(binary.trace([toy[4], n])) for n in (n1, n2)}
            for cpu in CPUS:
                with tempfile.NamedTemporaryFile("w", suffix=".s", delete=False) as f:
                    f.write(static_asm)
                outp = run([tools.mca, "-mtriple=aarch64", f"-mcpu={cpu}", "-iterations=1000", f.name])
                os.unlink(f.name)
                static = int(re.search(r"Total Cycles:\s+(\d+)", outp).group(1)) / 1000
                c = {n: mca.cycles(asm[n], cpu)[0] for n in (n1, n2)}
                dynamic = (c[n2] - c[n1]) / ((n2 - n1) / per_iteration)
                print(f"{toy} {CPU_SHORT[cpu]}: static loop {static:.3f} cycles/iteration "
                      f"({len(body)} instructions), dynamic trace {dynamic:.3f} "
                      f"(traces of {n1} and {n2} elements: {c[n1]} and {c[n2]} cycles)")


if __name__ == "__main__":
    main()
