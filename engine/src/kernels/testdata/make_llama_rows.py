#!/usr/bin/env python3
"""Writes llama_rows_<type>.bin: weight rows, the f32 activations llama.cpp multiplied them with,
and the f32 result llama.cpp's CPU backend produced, for the kernels' golden tests.

  make_llama_rows.py TYPE MODEL.gguf TAPS.npz OUT.bin

TAPS.npz holds llama.cpp's graph tensors from a teacher-forced run of MODEL (captured through
llama-cpp-python's eval callback; names as llama.cpp gives them: `kqv_out-0`, `ffn_moe_down-0`,
...). Cases are picked where the result llama.cpp computed differs from the order bmoe used
before (so the test can tell the orders apart); the expected value is llama.cpp's, never ours.

Layout (little-endian): u32 case count, then per case u32 n_cols, u32 row bytes, the row bytes,
n_cols f32 activation, f32 expected.
"""
import struct
import sys
from fractions import Fraction

import gguf
import numpy as np

f32 = np.float32


def fma(a, b, c):
    return f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def red8(l):
    r = [f32(l[k + 4] + l[k]) for k in range(4)]
    r = [f32(r[0] + r[2]), f32(r[1] + r[3])]
    return f32(r[0] + r[1])


def q80_act(x):  # llama.cpp x86 quantize_row_q8_0
    out = []
    for b in x.reshape(-1, 32):
        amax = np.abs(b).max()
        idv = f32(f32(127) / amax) if amax != 0 else f32(0)
        out.append((f32(np.float16(f32(amax / f32(127)))), np.rint((b * idv).astype(f32)).astype(np.int64)))
    return out


def q8k(x):  # quantize_row_q8_K_ref
    out = []
    for b in x.reshape(-1, 256):
        mx = b[np.abs(b).argmax()]
        if mx == 0:
            out.append((f32(0), np.zeros(256, np.int64)))
            continue
        isc = f32(-127) / mx
        out.append((f32(1) / isc, np.rint((isc * b).astype(f32)).astype(np.int64)))
    return out


def half(a):
    return a.astype(np.uint8).copy().view(np.float16)[..., 0].astype(f32)


def q4k_parts(row):
    nb = len(row) // 144
    blk = row.reshape(nb, 144).astype(np.int64)
    res = []
    for b in blk:
        s = b[4:16]
        sc = [0] * 8
        mn = [0] * 8
        for j in range(4):
            sc[j] = s[j] & 63
            mn[j] = s[j + 4] & 63
            sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4)
            mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4)
        qs = b[16:]
        q = np.zeros(256, np.int64)
        for c in range(4):
            q[64 * c:64 * c + 32] = qs[32 * c:32 * c + 32] & 0xF
            q[64 * c + 32:64 * c + 64] = qs[32 * c:32 * c + 32] >> 4
        res.append((half(b[0:2]), half(b[2:4]), np.array(sc), np.array(mn), q))
    return res


def q4k_dot(row, x, order):
    acc = f32(0)
    accd = f32(0)
    accm = f32(0)
    for (d, dmin, sc, mn, q), (da, qa) in zip(q4k_parts(row), q8k(x)):
        sumi = int((sc[:, None] * (q.reshape(8, 32) * qa.reshape(8, 32))).sum())
        bs = qa.reshape(16, 16).sum(1)
        summ = int((mn * (bs[0::2] + bs[1::2])).sum())
        if order == "old":
            acc = f32(acc + f32(f32(f32(da * d) * f32(sumi)) - f32(f32(da * dmin) * f32(summ))))
        else:
            accd = fma(f32(sumi), f32(d * da), accd)
            accm = fma(f32(summ), f32(dmin * da), accm)
    return acc if order == "old" else f32(accd - accm)


def q0_dot(row, x, ty, order):
    bsz = 18 if ty == "q4_0" else 34
    blk = row.reshape(-1, bsz)
    lanes = [f32(0)] * 8
    acc = f32(0)
    for b, (blkb, (da, qa)) in enumerate(zip(blk, q80_act(x))):
        d = half(blkb[0:2])
        if ty == "q4_0":
            qs = blkb[2:].astype(np.int64)
            q = np.concatenate([(qs & 0xF) - 8, (qs >> 4) - 8])
        else:
            q = blkb[2:].copy().view(np.int8).astype(np.int64)
        dd = f32(d * da)
        if order == "old":
            lanes[b % 8] = f32(lanes[b % 8] + f32(dd * f32(int((q * qa).sum()))))
        elif ty == "q4_0":
            acc = fma(f32(int((q * qa).sum())), dd, acc)
        else:
            p = (q * qa).reshape(8, 4).sum(1)
            for k in range(8):
                lanes[k] = fma(dd, f32(int(p[k])), lanes[k])
    return acc if (order == "new" and ty == "q4_0") else red8(lanes)


def main():
    ty, model, taps, out = sys.argv[1:5]
    t = np.load(taps)
    r = gguf.GGUFReader(model)
    cases = []
    if ty == "q4_k":
        W = [x for x in r.tensors if x.name == "blk.0.ffn_down_exps.weight"][0]
        raw = np.asarray(W.data).reshape(-1).view(np.uint8)
        n_cols = int(W.shape[0])
        rb = n_cols // 256 * 144
        rows = raw.reshape(-1, rb)
        per = rows.shape[0] // int(W.shape[2])
        X = t["ffn_moe_swiglu-0"]
        Y = t["ffn_moe_down-0"]
        topk = t["ffn_moe_topk-0"]
        for tok in range(X.shape[0]):
            for k in range(4):
                for rr in range(per):
                    row = rows[int(topk[tok, k]) * per + rr]
                    x = X[tok, k].astype(f32)
                    y = f32(Y[tok, k, rr])
                    if q4k_dot(row, x, "new") == y != q4k_dot(row, x, "old"):
                        cases.append((n_cols, row, x, y))
                        break
                if len(cases) >= 4:
                    break
            if len(cases) >= 4:
                break
    else:
        W = [x for x in r.tensors if x.name == "blk.0.attn_output.weight"][0]
        raw = np.asarray(W.data).reshape(-1).view(np.uint8)
        n_cols = int(W.shape[0])
        rows = raw.reshape(int(W.shape[1]), -1)
        X = t["kqv_out-0"]
        Y = [t[k] for k in t.files if k.startswith("node_") and t[k].shape == (X.shape[0], rows.shape[0])][0]
        for tok in range(0, X.shape[0], 3):
            for rr in range(rows.shape[0]):
                x = X[tok].astype(f32)
                y = f32(Y[tok, rr])
                if y != 0 and q0_dot(rows[rr], x, ty, "new") == y != q0_dot(rows[rr], x, ty, "old"):
                    cases.append((n_cols, rows[rr], x, y))
                    break
            if len(cases) >= 4:
                break
    assert len(cases) >= 2, "too few discriminating cases"
    with open(out, "wb") as f:
        f.write(struct.pack("<I", len(cases)))
        for n_cols, row, x, y in cases:
            f.write(struct.pack("<II", n_cols, len(row)))
            f.write(row.tobytes())
            f.write(x.astype("<f4").tobytes())
            f.write(struct.pack("<f", y))
    print(ty, len(cases), "cases")


if __name__ == "__main__":
    main()
