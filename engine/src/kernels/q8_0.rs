//! Q8_0: blocks of 32 int8 with an f16 scale. A weight format (attention K/V in Q4_K_M files)
//! and the activation format for Q4_0 and Q8_0 weights.
//!
//! Summation order (shared by every path): a block's products are summed exactly in i32; block
//! `b` adds `(d_w · d_a) · sum` to lane `b % 8` (product rounded, then the add); the 8 lanes are
//! folded by [`super::reduce8`]. The AVX2 path computes 8 blocks' integer sums at once and
//! applies the same float operations lane-wise, so it matches the scalar bits.

use super::{f16_to_f32, f32_to_f16, reduce8, RawBlock, SimdLevel};

/// Values per block.
pub(super) const QK: usize = 32;

/// One Q8_0 block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ8_0 {
    /// Scale, f16 little-endian.
    pub(super) d: [u8; 2],
    pub(super) qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ8_0 {}

impl BlockQ8_0 {
    pub(super) const ZERO: BlockQ8_0 = BlockQ8_0 {
        d: [0; 2],
        qs: [0; QK],
    };
}

/// llama.cpp's reference quantizer: scale = absmax / 127, values rounded half away from zero.
pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ8_0]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (q, v) in b.qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
        b.d = f32_to_f16(d);
    }
}

pub(super) fn dequantize(src: &[BlockQ8_0], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        for (o, q) in y.iter_mut().zip(&b.qs) {
            *o = d * *q as f32;
        }
    }
}

/// The float term of one block, given its exact integer sum; shared by every path.
#[inline(always)]
pub(super) fn block_term(d_w: [u8; 2], d_a: [u8; 2], sum: i32) -> f32 {
    (f16_to_f32(d_w) * f16_to_f32(d_a)) * sum as f32
}

/// Dot of a row of Q8_0 weight blocks with Q8_0 activation blocks.
pub(super) fn dot(level: SimdLevel, w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => {
            // SAFETY: the level is only reported when AVX2/FMA/F16C are present.
            unsafe { dot_avx2(w, a) }
        }
        _ => dot_scalar(w, a),
    }
}

#[inline(always)]
fn block_sum(x: &BlockQ8_0, y: &BlockQ8_0) -> i32 {
    x.qs.iter()
        .zip(&y.qs)
        .map(|(p, q)| *p as i32 * *q as i32)
        .sum()
}

pub(super) fn dot_scalar(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    let mut lanes = [0f32; 8];
    for (b, (x, y)) in w.iter().zip(a).enumerate() {
        lanes[b % 8] += block_term(x.d, y.d, block_sum(x, y));
    }
    reduce8(&lanes)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    use std::arch::x86_64::*;
    let n = w.len().min(a.len());
    let full = n / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    let mut b = 0;
    while b < full {
        let mut sums = [_mm256_setzero_si256(); 8];
        let mut dw = [0u16; 8];
        let mut da = [0u16; 8];
        for k in 0..8 {
            let (x, y) = (&w[b + k], &a[b + k]);
            // SAFETY: each qs is 32 bytes; unaligned loads.
            let xv = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
            let yv = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
            sums[k] = unsafe { x86::mul_sum_i8(xv, yv) };
            dw[k] = u16::from_le_bytes(x.d);
            da[k] = u16::from_le_bytes(y.d);
        }
        let s = unsafe { x86::hsum_8x8(&sums) };
        // SAFETY: 8 u16 = 16 bytes each.
        let d = unsafe {
            _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(dw.as_ptr().cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(da.as_ptr().cast())),
            )
        };
        acc = _mm256_add_ps(acc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(s)));
        b += 8;
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    for b in full..n {
        lanes[b % 8] += block_term(w[b].d, a[b].d, block_sum(&w[b], &a[b]));
    }
    reduce8(&lanes)
}

/// AVX2 building blocks shared by the 32-value block formats.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    /// Sums of products of signed bytes, 4 adjacent pairs per i32 lane. Exact as long as one
    /// operand is in -127..=127 (activations always are): `maddubs` then sees at most
    /// 2 · 128 · 127 < 2^15.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256i {
        let ax = _mm256_sign_epi8(x, x);
        let sy = _mm256_sign_epi8(y, x);
        let dot = _mm256_maddubs_epi16(ax, sy);
        _mm256_madd_epi16(dot, _mm256_set1_epi16(1))
    }

    /// The total of each of 8 vectors, as the 8 lanes of one vector (in order).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn hsum_8x8(v: &[__m256i; 8]) -> __m256i {
        let h01 = _mm256_hadd_epi32(v[0], v[1]);
        let h23 = _mm256_hadd_epi32(v[2], v[3]);
        let h45 = _mm256_hadd_epi32(v[4], v[5]);
        let h67 = _mm256_hadd_epi32(v[6], v[7]);
        let h0123 = _mm256_hadd_epi32(h01, h23);
        let h4567 = _mm256_hadd_epi32(h45, h67);
        let lo = _mm256_permute2x128_si256(h0123, h4567, 0x20);
        let hi = _mm256_permute2x128_si256(h0123, h4567, 0x31);
        _mm256_add_epi32(lo, hi)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::testutil::*;
    use super::*;

    pub(crate) fn quantized(x: &[f32]) -> Vec<BlockQ8_0> {
        let mut b = vec![BlockQ8_0::ZERO; x.len() / QK];
        quantize(x, &mut b);
        b
    }

    /// Six standard deviations of the error an activation quantizer puts into a dot product
    /// when its error on each value is independent and at most `amax(block) · rel` (uniform:
    /// σ_i = amax · rel / √3). A statistical bound, but a fixed-seed test either always passes
    /// or always fails, and a wrong layout misses it by orders of magnitude.
    pub(crate) fn act_error_bound(w: &[f32], a: &[f32], block: usize, rel: f64) -> f64 {
        let var: f64 = w
            .chunks(block)
            .zip(a.chunks(block))
            .map(|(wb, ab)| {
                let amax = ab.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
                let sigma = amax * rel / 3f64.sqrt();
                wb.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() * sigma * sigma
            })
            .sum();
        6.0 * var.sqrt()
    }

    #[test]
    fn simd_matches_scalar_bits() {
        for (seed, nb) in [(1u64, 1usize), (2, 7), (3, 8), (4, 19), (5, 128)] {
            let w = quantized(&values(seed, nb * QK, 0.1));
            let a = quantized(&values(seed + 50, nb * QK, 1.0));
            let s = dot_scalar(&w, &a);
            for level in SimdLevel::available() {
                assert_eq!(
                    dot(level, &w, &a).to_bits(),
                    s.to_bits(),
                    "{level:?} seed={seed}"
                );
            }
        }
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        for seed in [21u64, 22, 23] {
            let n = 4096;
            let wq = quantized(&values(seed, n, 0.1));
            let mut w = vec![0f32; n];
            dequantize(&wq, &mut w);
            let a = values(seed + 7, n, 1.0);
            let aq = quantized(&a);
            let mut a_deq = vec![0f32; n];
            dequantize(&aq, &mut a_deq);
            let got = dot_scalar(&wq, &aq);
            assert_matches_dequantized(got, &w, &a_deq, &format!("seed={seed}"));
            // Against the unquantized activation: the activation's rounding error.
            let got = got as f64;
            // Activation error per value ≤ amax/254 (rounding) + amax·2^-11 (f16 scale), plus
            // float rounding of the block terms and the 8-lane chain.
            let bound = act_error_bound(&w, &a, QK, (1.0 / 254.0 + 2f64.powi(-11)) * 1.001)
                + abs_dot_f64(&w, &a) * 64.0 * f32::EPSILON as f64;
            let err = (got - dot_f64(&w, &a)).abs();
            assert!(err <= bound, "seed={seed} err={err} bound={bound}");
        }
    }

    #[test]
    fn round_trip_error_within_half_a_step() {
        let x = values(9, 32 * 64, 1.0);
        let mut back = vec![0f32; x.len()];
        dequantize(&quantized(&x), &mut back);
        for (xb, yb) in x.chunks(QK).zip(back.chunks(QK)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (p, q) in xb.iter().zip(yb) {
                assert!((p - q).abs() <= amax * (1.0 / 254.0 + 2f32.powi(-11)) * 1.001);
            }
        }
        // All-zero blocks stay zero (no division by zero).
        let z = quantized(&[0.0; 32]);
        assert_eq!(z[0], BlockQ8_0::ZERO);
    }
}
