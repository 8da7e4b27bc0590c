//! F16 weights against f16 activations (as llama.cpp's CPU backend converts the activation to
//! the weight's type before the dot).
//!
//! Both operands are converted to f32 exactly; the product of two f16 values is exact in f32
//! (11 × 11 significant bits), so only the adds round. Summation order as for F32: product `i`
//! into lane `i % 32`, lanes folded by [`super::reduce32`]; the AVX2 path (F16C conversion,
//! 4 × 8 lanes) gives exactly the scalar bits.

use super::{reduce32, SimdLevel};

const SIZE: usize = 2;

pub(super) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (d, v) in dst.chunks_exact_mut(SIZE).zip(src) {
        d.copy_from_slice(&half::f16::from_f32(*v).to_bits().to_le_bytes());
    }
}

pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(SIZE)) {
        *d = to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

#[inline(always)]
fn to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

#[inline(always)]
fn weight(w: &[u8], i: usize) -> f32 {
    to_f32(u16::from_le_bytes([w[SIZE * i], w[SIZE * i + 1]]))
}

/// Dot of a row of f16 weights (`w`, little-endian bytes) with f16 activations `a` (bits).
pub(super) fn dot(level: SimdLevel, w: &[u8], a: &[u16]) -> f32 {
    simd_dispatch!(level, dot_avx2(w, a), dot_scalar(w, a))
}

pub(super) fn dot_scalar(w: &[u8], a: &[u16]) -> f32 {
    let n = a.len().min(w.len() / SIZE);
    let mut lanes = [0f32; 32];
    for i in 0..n {
        lanes[i % 32] += weight(w, i) * to_f32(a[i]);
    }
    reduce32(&lanes)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(w: &[u8], a: &[u16]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(w.len() / SIZE);
    let full = n / 32 * 32;
    let wp = w.as_ptr().cast::<u16>();
    let ap = a.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < full {
        for (k, acc_k) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8k + 8 <= full <= n, inside both slices; unaligned loads.
            let x = unsafe { _mm_loadu_si128(wp.add(i + 8 * k).cast()) };
            let y = unsafe { _mm_loadu_si128(ap.add(i + 8 * k).cast()) };
            let p = _mm256_mul_ps(_mm256_cvtph_ps(x), _mm256_cvtph_ps(y));
            *acc_k = _mm256_add_ps(*acc_k, p);
        }
        i += 32;
    }
    let mut lanes = [0f32; 32];
    for (k, acc_k) in acc.iter().enumerate() {
        // SAFETY: lanes has room for 8 floats at 8k.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * k), *acc_k) };
    }
    for i in full..n {
        lanes[i % 32] += weight(w, i) * to_f32(a[i]);
    }
    reduce32(&lanes)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    dot_kernel!(F16, F16, Vec<u16>, |x| act_u16(GgmlType::F16, x), bytes);

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<F16>(&[(1, 1), (2, 31), (3, 32), (4, 333), (5, 4096)], 100);
    }

    #[test]
    fn scalar_is_close_to_f32_reference() {
        // The activation's fp16 rounding is 2^-11 relative.
        check_float_scalar_against_reference::<F16>(2f64.powi(-11));
    }

    #[test]
    fn round_trip_within_half_an_f16_ulp() {
        let v = values(3, 1000, 1.0);
        for (x, y) in v.iter().zip(&round_trip(GgmlType::F16, &v)) {
            assert!(
                (x - y).abs() <= x.abs() * 2f32.powi(-11) + 2f32.powi(-25),
                "{x} {y}"
            );
        }
    }
}
