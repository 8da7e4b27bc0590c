//! Q8_K's activation quantizer with NEON: the scalar's bytes ([`super::quantize`]), four
//! values a step.
//!
//! Why it needs no rounding trick: `fcvtns` rounds to nearest, ties to even, saturates and
//! turns NaN into 0 — exactly the scalar's `nearest_int` followed by its clamp, for every
//! product (the AVX2 form adds 1.5 · 2^23 and must hand products of 2^21 and more back to the
//! scalar code). The one case left to the scalar code is a block holding a NaN: the absmax is
//! taken by `fmax`, which passes a NaN on, where the scalar's `>` skips it.

use super::{BlockQ8K, QK_K};
use std::arch::aarch64::*;

/// [`super::quantize`], block by block.
pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ8K]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
        if !block(x, b) {
            super::quantize(x, std::slice::from_mut(b));
        }
    }
}

/// One block of 256 values; false (and `b` untouched) when it holds a NaN.
fn block(x: &[f32], b: &mut BlockQ8K) -> bool {
    assert_eq!(x.len(), QK_K);
    let p = x.as_ptr();
    // SAFETY (every load here): 4 values at 16·i + 4·j < QK_K = x.len(); the rest is
    // register-only NEON.
    let amax = unsafe {
        let mut m = [vdupq_n_f32(0.0); 4];
        for i in 0..QK_K / 16 {
            for (j, m) in m.iter_mut().enumerate() {
                *m = vmaxq_f32(*m, vabsq_f32(vld1q_f32(p.add(16 * i + 4 * j))));
            }
        }
        vmaxvq_f32(vmaxq_f32(vmaxq_f32(m[0], m[1]), vmaxq_f32(m[2], m[3])))
    };
    if amax.is_nan() {
        return false;
    }
    if amax == 0.0 {
        *b = BlockQ8K::ZERO;
        return true;
    }
    // The signed value of the first element reaching the absmax (the scalar's strict `>`
    // keeps the first).
    let mut max = amax;
    for i in 0..QK_K / 16 {
        // SAFETY: as above.
        let hit = unsafe {
            let a = vdupq_n_f32(amax);
            let h: [uint32x4_t; 4] =
                std::array::from_fn(|j| vceqq_f32(vabsq_f32(vld1q_f32(p.add(16 * i + 4 * j))), a));
            vmaxvq_u32(vorrq_u32(vorrq_u32(h[0], h[1]), vorrq_u32(h[2], h[3])))
        };
        if hit != 0 {
            let run = &x[16 * i..16 * i + 16];
            max = run
                .iter()
                .copied()
                .find(|v| v.abs() == amax)
                .unwrap_or(amax);
            break;
        }
    }
    let iscale = -127.0 / max;
    let qs = b.qs.as_mut_ptr();
    let mut runs = [[0i16; 8]; 2];
    // SAFETY: the loads as above; 16-byte stores at 16·r < QK_K inside `qs`, 8 i16 into each
    // half of `runs`; the rest is register-only NEON.
    unsafe {
        let scale = vdupq_n_f32(iscale);
        let floor = vdupq_n_s8(-127);
        for half in 0..2 {
            // Per run of 16 values its bytes' pair sums, then pairs of those, three times.
            let mut pairs = [vdupq_n_s16(0); 8];
            for (g, pair) in pairs.iter_mut().enumerate() {
                let r = 8 * half + g;
                let q: [int32x4_t; 4] = std::array::from_fn(|j| {
                    vcvtnq_s32_f32(vmulq_f32(scale, vld1q_f32(p.add(16 * r + 4 * j))))
                });
                let h0 = vqmovn_high_s32(vqmovn_s32(q[0]), q[1]);
                let h1 = vqmovn_high_s32(vqmovn_s32(q[2]), q[3]);
                let v = vmaxq_s8(vqmovn_high_s16(vqmovn_s16(h0), h1), floor);
                vst1q_s8(qs.add(16 * r), v);
                *pair = vpaddlq_s8(v);
            }
            let quarters: [int16x8_t; 4] =
                std::array::from_fn(|k| vpaddq_s16(pairs[2 * k], pairs[2 * k + 1]));
            let halves = [
                vpaddq_s16(quarters[0], quarters[1]),
                vpaddq_s16(quarters[2], quarters[3]),
            ];
            // Each run's sum (at most 16 · 127: exact in i16), in run order.
            vst1q_s16(runs[half].as_mut_ptr(), vpaddq_s16(halves[0], halves[1]));
        }
    }
    b.bsums[..8].copy_from_slice(&runs[0]);
    b.bsums[8..].copy_from_slice(&runs[1]);
    b.d = 1.0 / iscale;
    true
}
