#!/usr/bin/env python3
"""llama.cpp's own CPU kernels as an independent reference for bmoe's: its quantizer,
dequantizer and dot product of the very same blocks, called through ctypes in the ggml
libraries the PyPI `llama-cpp-python` package ships (so no llama.cpp build is needed), with the
PyPI `gguf` package's numpy dequantizer as a second opinion.

  ggml_ref.py batch JOBS.json

JOBS.json is a list of jobs run in order (a job may read a file an earlier one wrote):
  {"op": "quantize", "type": T, "in": F32_FILE, "n_per_row": N, "out": BYTES_FILE}
      ggml_quantize_chunk: rows of N f32 values to type T (what llama-quantize writes, without
      an importance matrix)
  {"op": "dequantize", "type": T, "in": BYTES_FILE, "out": F32_FILE}
      ggml's dequantize_row_<t> (fp16/bf16 row converters for F16/BF16); the gguf package's
      dequantizer must give the same bits (NaN payloads aside) or the job fails
  {"op": "dot", "type": T, "in": BYTES_FILE, "n_per_row": N, "x": F32_FILE, "out": F32_FILE}
      per row: the activation x quantized by ggml's CPU backend for T (its vec_dot_type's
      from_float), then T's vec_dot: one f32 per row, llama.cpp's bits for that row
Types are ggml names (Q4_K, IQ4_XS, MXFP4, F16, ...). Exit status 2 when a package is missing,
1 on any other failure (the message names the job).
"""
import ctypes
import json
import os
import sys

try:
    import numpy as np
    import gguf
    import gguf.quants
    import llama_cpp
except ImportError as e:  # pragma: no cover - environment dependent
    print(f"ggml_ref.py: {e}; pip install -r scripts/requirements-test.txt", file=sys.stderr)
    sys.exit(2)

LIB = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")


def load(name):
    for f in (f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
        p = os.path.join(LIB, f)
        if os.path.exists(p):
            return ctypes.CDLL(p)
    sys.exit(f"ggml_ref.py: lib{name} not found in {LIB}")


BASE = load("ggml-base")
CPU = load("ggml-cpu")
CPU.ggml_cpu_init()

FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class TraitsCpu(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


CPU.ggml_get_type_traits_cpu.restype = ctypes.POINTER(TraitsCpu)
CPU.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
BASE.ggml_quantize_chunk.restype = ctypes.c_size_t
BASE.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]


def qtype(name):
    return gguf.GGMLQuantizationType[name]


def geometry(t):
    return gguf.GGML_QUANT_SIZES[t]


def f32(p):
    return np.fromfile(p, dtype="<f4")


def c_dequantize(t, raw):
    block, size = geometry(t)
    n = len(raw) // size * block
    out = np.zeros(n, dtype=np.float32)
    src = np.frombuffer(raw, dtype=np.uint8)
    if t == qtype("F32"):
        return src.view("<f4").copy()
    fn = {"F16": "ggml_fp16_to_fp32_row", "BF16": "ggml_bf16_to_fp32_row"}.get(t.name)
    # ggml spells the K-quants with a capital K (dequantize_row_q4_K).
    fn = getattr(BASE, fn or f"dequantize_row_{t.name.lower().replace('_k', '_K')}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn(src.ctypes.data, out.ctypes.data, n)
    return out


def same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


def job_quantize(j):
    t = qtype(j["type"])
    x = f32(j["in"])
    n = int(j["n_per_row"])
    rows = len(x) // n
    block, size = geometry(t)
    out = np.zeros(rows * n // block * size, dtype=np.uint8)
    BASE.ggml_quantize_chunk(int(t), x.ctypes.data, out.ctypes.data, 0, rows, n, None)
    out.tofile(j["out"])


def job_dequantize(j):
    t = qtype(j["type"])
    raw = open(j["in"], "rb").read()
    c = c_dequantize(t, raw)
    py = gguf.quants.dequantize(np.frombuffer(raw, dtype=np.uint8), t).reshape(-1)
    if not same_bits(c, py):
        bad = int(np.argmax(~((c.view(np.uint32) == py.view(np.uint32)) | (np.isnan(c) & np.isnan(py)))))
        raise ValueError(f"ggml and gguf-py dequantize {t.name} differently (value {bad}: {c[bad]} vs {py[bad]})")
    c.astype("<f4").tofile(j["out"])


def job_dot(j):
    t = qtype(j["type"])
    raw = np.frombuffer(open(j["in"], "rb").read(), dtype=np.uint8)
    n = int(j["n_per_row"])
    x = f32(j["x"])
    assert len(x) == n, f"activation has {len(x)} values, rows {n}"
    tr = CPU.ggml_get_type_traits_cpu(int(t)).contents
    at = gguf.GGMLQuantizationType(tr.vec_dot_type)
    act_tr = CPU.ggml_get_type_traits_cpu(int(at)).contents
    ablock, asize = geometry(at)
    act = np.zeros(n // ablock * asize, dtype=np.uint8)
    FROM_FLOAT(act_tr.from_float)(x.ctypes.data, act.ctypes.data, n)
    block, size = geometry(t)
    row_bytes = n // block * size
    rows = len(raw) // row_bytes
    out = np.zeros(rows, dtype=np.float32)
    dot = VEC_DOT(tr.vec_dot)
    for r in range(rows):
        s = ctypes.c_float()
        dot(n, ctypes.addressof(s), 0, raw.ctypes.data + r * row_bytes, 0, act.ctypes.data, 0, 1)
        out[r] = s.value
    out.astype("<f4").tofile(j["out"])


def main():
    if len(sys.argv) != 3 or sys.argv[1] != "batch":
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 1)
    jobs = json.load(open(sys.argv[2]))
    ops = {"quantize": job_quantize, "dequantize": job_dequantize, "dot": job_dot}
    for i, j in enumerate(jobs):
        try:
            ops[j["op"]](j)
        except Exception as e:  # noqa: BLE001 - reported with the job that failed
            sys.exit(f"ggml_ref.py: job {i} {j}: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
