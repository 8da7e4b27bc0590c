//! The float formats' dot (F32, F16, BF16) with NEON: the scalar's 32 lanes as 8 vectors of
//! 4, the products rounded before the add, the same tail and fold ([`super::dot_scalar`]), so
//! the same bits.
//!
//! Why three loops: each format widens its values its own way, and two of them have one
//! instruction for the whole step on the cores that have the feature (checked at run time,
//! not a [`super::super::SimdLevel`]: a core's fp16/bf16 extensions are independent of its
//! dotprod/i8mm):
//! - F32: `fmul` then `fadd` (a fused multiply-add would round once, not twice). Those two
//!   per 4 values are the vector pipes' whole work (on Neoverse N2, with two, exactly ggml's
//!   64 cycles per 256 weights of fused multiply-adds waiting on their latency), so the
//!   one-token product ([`Kernel::dot_rows`]) takes two rows a step: each activation load
//!   serves both, which leaves the load pipes room for the prefetches.
//! - F16: `fmlal`/`fmlal2` (FEAT_FHM) multiply f16 pairs and add to f32 lanes in one rounding.
//!   The product of two f16 values is exact in f32 (11 × 11 significant bits), so that one
//!   rounding is the scalar's add. Without FHM, `fcvtl` widens, then `fmul` (exact) and
//!   `fadd`.
//! - BF16: `bfmlalb`/`bfmlalt` (FEAT_BF16) are the same fused step for bf16 (8 × 8 bits, exact
//!   products) on the even and the odd values of a vector; the lanes they fill are the
//!   scalar's lanes interleaved, put back in order once at the end. Without BF16, the values
//!   are widened by interleaving them with zeros (bf16 is the upper half of an f32).

use super::super::bf16::Bf16;
use super::super::format::{prefetch_lines, Kernel, Neon, PREFETCH_AHEAD};
use super::super::fp16::F16;
use super::super::fp32::F32;
use super::super::neon::{f16x4_to_f32, f16x8_high_to_f32};
use super::super::reduce32;
use super::FloatFormat;
use std::arch::aarch64::*;
use std::arch::asm;
use std::ops::Range;

impl Kernel<F32> for Neon {
    unsafe fn dot(w: &[[u8; 4]], a: &[f32]) -> f32 {
        // SAFETY: NEON is in every aarch64 core.
        unsafe { dot_f32(w.as_flattened(), a) }
    }

    /// Two rows a step ([`dot_f32_rows`]), each prefetched as the default does: the same
    /// lines, [`PREFETCH_AHEAD`] bytes past the row's start, one row's worth (clipped to
    /// `w`), but issued two per row and step of the loop (a row pair's dozens of `prfm`s at
    /// once held the loads up behind them: 69 cycles per 256 weights on Neoverse N2 under
    /// llvm-mca, 64 without prefetches or spread).
    unsafe fn dot_rows(w: &[u8], row_bytes: usize, rows: Range<usize>, a: &[f32], out: &mut [f32]) {
        let (first, mut r) = (rows.start, rows.start);
        while r < rows.end {
            let o = &mut out[r - first..];
            let row = |k: usize| &w[(r + k) * row_bytes..(r + k + 1) * row_bytes];
            if rows.end - r == 1 {
                prefetch_lines(w, r * row_bytes + PREFETCH_AHEAD, row_bytes);
                // SAFETY: NEON only.
                o[0] = unsafe { dot_f32(row(0), a) };
                break;
            }
            // The loop's prefetches stay below `w.len()`: a step at byte `b` of the second
            // row reaches `(r + 1) · row_bytes + b + PREFETCH_AHEAD + 127`.
            let room = w
                .len()
                .saturating_sub((r + 1) * row_bytes + PREFETCH_AHEAD + 128);
            // SAFETY: NEON only; the prefetches as just said.
            let (v, done) = unsafe { dot_f32_rows([row(0), row(1)], a, room / 128 * 32) };
            o[..2].copy_from_slice(&v);
            // The lines the loop's steps did not reach.
            for k in 0..2 {
                let at = (r + k) * row_bytes + PREFETCH_AHEAD + done;
                prefetch_lines(w, at, row_bytes.saturating_sub(done));
            }
            r += 2;
        }
    }
}

impl Kernel<F16> for Neon {
    unsafe fn dot(w: &[[u8; 2]], a: &[u16]) -> f32 {
        if std::arch::is_aarch64_feature_detected!("fhm") {
            // SAFETY: the CPU has FHM (and so FP16), checked just now.
            unsafe { dot_f16_fhm(w.as_flattened(), a) }
        } else {
            // SAFETY: NEON only.
            unsafe { dot_f16(w.as_flattened(), a) }
        }
    }
}

impl Kernel<Bf16> for Neon {
    unsafe fn dot(w: &[[u8; 2]], a: &[u16]) -> f32 {
        if std::arch::is_aarch64_feature_detected!("bf16") {
            // SAFETY: the CPU has BF16, checked just now.
            unsafe { dot_bf16_bfmlal(w.as_flattened(), a) }
        } else {
            // SAFETY: NEON only.
            unsafe { dot_bf16(w.as_flattened(), a) }
        }
    }
}

/// The values the full 32-value steps cover, and all of them: `min(a.len(), w.len() / size)`.
#[inline(always)]
fn extent(w: &[u8], a_len: usize, size: usize) -> (usize, usize) {
    let n = a_len.min(w.len() / size);
    (n / 32 * 32, n)
}

/// The 8 lane vectors (vector `k` holds lanes `4k .. 4k + 4`), the scalar's tail from value
/// `full` to `n`, and its fold.
#[inline(always)]
fn finish<F: FloatFormat>(
    acc: &[float32x4_t; 8],
    w: &[u8],
    a: &[F::Act],
    full: usize,
    n: usize,
) -> f32 {
    let mut lanes = [0f32; 32];
    for (k, v) in acc.iter().enumerate() {
        // SAFETY: 4 floats at 4k < 32 inside `lanes`.
        unsafe { vst1q_f32(lanes.as_mut_ptr().add(4 * k), *v) };
    }
    for i in full..n {
        lanes[i % 32] += F::weight(w, i) * F::act(a[i]);
    }
    reduce32(&lanes)
}

/// 8 × 16 bits at byte `at` of `p` (unaligned).
///
/// # Safety
/// The 16 bytes lie inside the caller's slice.
#[inline(always)]
unsafe fn load_u16x8(p: *const u8, at: usize) -> uint16x8_t {
    // SAFETY: the caller's; `ld1` of bytes has no alignment requirement.
    unsafe { vreinterpretq_u16_u8(vld1q_u8(p.add(at))) }
}

unsafe fn dot_f32(w: &[u8], a: &[f32]) -> f32 {
    let (full, n) = extent(w, a.len(), 4);
    let (wp, ap) = (w.as_ptr(), a.as_ptr());
    // SAFETY (the loop's loads): values `i + 4k .. i + 4k + 4` with `i + 32 <= full <= n` lie
    // inside both slices; the rest is register-only NEON.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 8];
        let mut i = 0;
        while i < full {
            for (k, acc_k) in acc.iter_mut().enumerate() {
                let x = vreinterpretq_f32_u8(vld1q_u8(wp.add(4 * (i + 4 * k))));
                let y = vld1q_f32(ap.add(i + 4 * k));
                *acc_k = vaddq_f32(*acc_k, vmulq_f32(x, y));
            }
            i += 32;
        }
        finish::<F32>(&acc, w, a, full, n)
    }
}

/// [`dot_f32`] of two rows of the same length at once, each activation vector loaded once
/// for both; each row's lanes, tail and fold are [`dot_f32`]'s. The loop's first `pf` values
/// of each row (a multiple of 32) also prefetch, per step of 32, the two lines
/// [`PREFETCH_AHEAD`] bytes past the step's 128 bytes. Returns the values and the bytes of
/// each row whose lines `PREFETCH_AHEAD` ahead were so prefetched.
///
/// # Safety
/// Every byte up to `PREFETCH_AHEAD + 128` past each row's first `4 · pf` bytes lies in the
/// caller's slice ([`prefetch_lines`]' rule: a prefetch never faults, but it reads only the
/// caller's bytes).
unsafe fn dot_f32_rows(w: [&[u8]; 2], a: &[f32], pf: usize) -> ([f32; 2], usize) {
    const { assert!(PREFETCH_AHEAD % 8 == 0 && PREFETCH_AHEAD + 64 <= 32760) };
    let (full, n) = extent(w[0], a.len(), 4);
    let pf = pf.min(full);
    let (w0, w1, ap) = (w[0].as_ptr(), w[1].as_ptr(), a.as_ptr());
    let mut acc0 = [vdupq_n_f32(0.0); 8];
    let mut acc1 = [vdupq_n_f32(0.0); 8];
    // SAFETY (every load): values `i .. i + 32` with `i + 32 <= full <= n` lie inside the
    // activation and both rows; the rest is register-only NEON.
    let step = |i: usize, acc0: &mut [float32x4_t; 8], acc1: &mut [float32x4_t; 8]| unsafe {
        for k in 0..8 {
            let y = vld1q_f32(ap.add(i + 4 * k));
            let x0 = vreinterpretq_f32_u8(vld1q_u8(w0.add(4 * (i + 4 * k))));
            let x1 = vreinterpretq_f32_u8(vld1q_u8(w1.add(4 * (i + 4 * k))));
            acc0[k] = vaddq_f32(acc0[k], vmulq_f32(x0, y));
            acc1[k] = vaddq_f32(acc1[k], vmulq_f32(x1, y));
        }
    };
    let mut i = 0;
    while i < pf {
        for p in [w0 as usize + 4 * i, w1 as usize + 4 * i] {
            // SAFETY: the caller's bytes (see above); a prefetch changes no value.
            unsafe {
                asm!(
                    "prfm pldl1keep, [{p}, #{a}]",
                    "prfm pldl1keep, [{p}, #{b}]",
                    p = in(reg) p,
                    a = const PREFETCH_AHEAD,
                    b = const PREFETCH_AHEAD + 64,
                    options(nostack, preserves_flags, readonly)
                )
            };
        }
        step(i, &mut acc0, &mut acc1);
        i += 32;
    }
    while i < full {
        step(i, &mut acc0, &mut acc1);
        i += 32;
    }
    let v = [
        finish::<F32>(&acc0, w[0], a, full, n),
        finish::<F32>(&acc1, w[1], a, full, n),
    ];
    (v, 4 * pf)
}

unsafe fn dot_f16(w: &[u8], a: &[u16]) -> f32 {
    let (full, n) = extent(w, a.len(), 2);
    let (wp, ap) = (w.as_ptr(), a.as_ptr().cast::<u8>());
    // SAFETY: as in `dot_f32` (values `i + 8c .. i + 8c + 8` of both rows).
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 8];
        let mut i = 0;
        while i < full {
            for c in 0..4 {
                let x = load_u16x8(wp, 2 * (i + 8 * c));
                let y = load_u16x8(ap, 2 * (i + 8 * c));
                let lo = vmulq_f32(f16x4_to_f32(vget_low_u16(x)), f16x4_to_f32(vget_low_u16(y)));
                let hi = vmulq_f32(f16x8_high_to_f32(x), f16x8_high_to_f32(y));
                acc[2 * c] = vaddq_f32(acc[2 * c], lo);
                acc[2 * c + 1] = vaddq_f32(acc[2 * c + 1], hi);
            }
            i += 32;
        }
        finish::<F16>(&acc, w, a, full, n)
    }
}

/// `acc + a[0..4] · b[0..4]`, f16 values into f32 lanes, one rounding (`fmlal`).
///
/// # Safety
/// The CPU has FEAT_FHM.
#[inline]
#[target_feature(enable = "fp16,fhm")]
unsafe fn fmlal(mut acc: float32x4_t, a: uint16x8_t, b: uint16x8_t) -> float32x4_t {
    // SAFETY: register-only instruction of a feature this function requires.
    unsafe {
        asm!(
            "fmlal {acc:v}.4s, {a:v}.4h, {b:v}.4h",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    acc
}

/// [`fmlal`] of the upper four values (`fmlal2`).
///
/// # Safety
/// The CPU has FEAT_FHM.
#[inline]
#[target_feature(enable = "fp16,fhm")]
unsafe fn fmlal2(mut acc: float32x4_t, a: uint16x8_t, b: uint16x8_t) -> float32x4_t {
    // SAFETY: register-only instruction of a feature this function requires.
    unsafe {
        asm!(
            "fmlal2 {acc:v}.4s, {a:v}.4h, {b:v}.4h",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    acc
}

#[target_feature(enable = "fp16,fhm")]
unsafe fn dot_f16_fhm(w: &[u8], a: &[u16]) -> f32 {
    let (full, n) = extent(w, a.len(), 2);
    let (wp, ap) = (w.as_ptr(), a.as_ptr().cast::<u8>());
    // SAFETY: as in `dot_f16`; FHM is the caller's.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 8];
        let mut i = 0;
        while i < full {
            for c in 0..4 {
                let x = load_u16x8(wp, 2 * (i + 8 * c));
                let y = load_u16x8(ap, 2 * (i + 8 * c));
                acc[2 * c] = fmlal(acc[2 * c], x, y);
                acc[2 * c + 1] = fmlal2(acc[2 * c + 1], x, y);
            }
            i += 32;
        }
        finish::<F16>(&acc, w, a, full, n)
    }
}

unsafe fn dot_bf16(w: &[u8], a: &[u16]) -> f32 {
    let (full, n) = extent(w, a.len(), 2);
    let (wp, ap) = (w.as_ptr(), a.as_ptr().cast::<u8>());
    // SAFETY: as in `dot_f16`.
    unsafe {
        let zero = vdupq_n_u16(0);
        // A bf16 value with 16 zero bits below it is its f32.
        let lo = |v| vreinterpretq_f32_u16(vzip1q_u16(zero, v));
        let hi = |v| vreinterpretq_f32_u16(vzip2q_u16(zero, v));
        let mut acc = [vdupq_n_f32(0.0); 8];
        let mut i = 0;
        while i < full {
            for c in 0..4 {
                let x = load_u16x8(wp, 2 * (i + 8 * c));
                let y = load_u16x8(ap, 2 * (i + 8 * c));
                acc[2 * c] = vaddq_f32(acc[2 * c], vmulq_f32(lo(x), lo(y)));
                acc[2 * c + 1] = vaddq_f32(acc[2 * c + 1], vmulq_f32(hi(x), hi(y)));
            }
            i += 32;
        }
        finish::<Bf16>(&acc, w, a, full, n)
    }
}

/// `acc[j] + a[2j] · b[2j]` (`bfmlalb`, the even bf16 values): fused, one rounding to nearest
/// even as in single-precision arithmetic.
///
/// # Safety
/// The CPU has FEAT_BF16.
#[inline]
#[target_feature(enable = "bf16")]
unsafe fn bfmlalb(mut acc: float32x4_t, a: uint16x8_t, b: uint16x8_t) -> float32x4_t {
    // SAFETY: register-only instruction of a feature this function requires.
    unsafe {
        asm!(
            "bfmlalb {acc:v}.4s, {a:v}.8h, {b:v}.8h",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    acc
}

/// [`bfmlalb`] of the odd values (`bfmlalt`): `acc[j] + a[2j + 1] · b[2j + 1]`.
///
/// # Safety
/// The CPU has FEAT_BF16.
#[inline]
#[target_feature(enable = "bf16")]
unsafe fn bfmlalt(mut acc: float32x4_t, a: uint16x8_t, b: uint16x8_t) -> float32x4_t {
    // SAFETY: register-only instruction of a feature this function requires.
    unsafe {
        asm!(
            "bfmlalt {acc:v}.4s, {a:v}.8h, {b:v}.8h",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    acc
}

#[target_feature(enable = "bf16")]
unsafe fn dot_bf16_bfmlal(w: &[u8], a: &[u16]) -> f32 {
    let (full, n) = extent(w, a.len(), 2);
    let (wp, ap) = (w.as_ptr(), a.as_ptr().cast::<u8>());
    // SAFETY: as in `dot_f16`; BF16 is the caller's.
    unsafe {
        // even[c] lane j: value 8c + 2j of each 32; odd[c] lane j: value 8c + 2j + 1.
        let mut even = [vdupq_n_f32(0.0); 4];
        let mut odd = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i < full {
            for c in 0..4 {
                let x = load_u16x8(wp, 2 * (i + 8 * c));
                let y = load_u16x8(ap, 2 * (i + 8 * c));
                even[c] = bfmlalb(even[c], x, y);
                odd[c] = bfmlalt(odd[c], x, y);
            }
            i += 32;
        }
        // Back to the scalar's lanes: values 8c .. 8c + 4 and 8c + 4 .. 8c + 8.
        let acc: [float32x4_t; 8] = std::array::from_fn(|k| {
            let c = k / 2;
            if k % 2 == 0 {
                vzip1q_f32(even[c], odd[c])
            } else {
                vzip2q_f32(even[c], odd[c])
            }
        });
        finish::<Bf16>(&acc, w, a, full, n)
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::testutil::{bytes, values};
    use super::super::dot_scalar;
    use super::*;

    /// Every loop, with and without its extension (where this CPU has it), gives the scalar's
    /// bits on random bytes (any f16/bf16/f32: denormals, infinities, NaNs) and on ordinary
    /// values, at lengths with and without a tail.
    #[test]
    fn every_loop_matches_the_scalar_bits() {
        let fhm = std::arch::is_aarch64_feature_detected!("fhm");
        let bf16 = std::arch::is_aarch64_feature_detected!("bf16");
        if !fhm || !bf16 {
            eprintln!("fhm {fhm}, bf16 {bf16}: only the loops this CPU has are compared");
        }
        let same =
            |got: f32, want: f32| got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan();
        for (seed, n) in [
            (1u64, 1usize),
            (2, 31),
            (3, 32),
            (4, 95),
            (5, 1000),
            (6, 4096),
        ] {
            for random in [false, true] {
                let (w4, a4): (Vec<u8>, Vec<f32>) = if random {
                    let a = bytes(seed + 50, 4 * n);
                    let a = a
                        .chunks(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()));
                    (bytes(seed, 4 * n), a.collect())
                } else {
                    let w = values(seed, n, 0.1)
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect();
                    (w, values(seed + 50, n, 1.0))
                };
                // SAFETY (every call): NEON; the extensions only where detected.
                let got = unsafe { dot_f32(&w4, &a4) };
                assert!(
                    same(got, dot_scalar::<F32>(&w4, &a4)),
                    "f32 n={n} random={random}"
                );
                let w2 = &w4[..2 * n];
                let a2: Vec<u16> = a4.iter().map(|v| (v.to_bits() >> 7) as u16).collect();
                let want = dot_scalar::<F16>(w2, &a2);
                assert!(
                    same(unsafe { dot_f16(w2, &a2) }, want),
                    "f16 n={n} random={random}"
                );
                if fhm {
                    let got = unsafe { dot_f16_fhm(w2, &a2) };
                    assert!(
                        same(got, want),
                        "f16 fhm n={n} random={random}: {got} vs {want}"
                    );
                }
                let want = dot_scalar::<Bf16>(w2, &a2);
                assert!(
                    same(unsafe { dot_bf16(w2, &a2) }, want),
                    "bf16 n={n} random={random}"
                );
                if bf16 {
                    let got = unsafe { dot_bf16_bfmlal(w2, &a2) };
                    assert!(
                        same(got, want),
                        "bf16 bfmlal n={n} random={random}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
