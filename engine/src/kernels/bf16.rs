//! BF16 weights against bf16 activations (as llama.cpp's CPU backend converts the activation to
//! the weight's type before the dot).
//!
//! Both operands are converted to f32 exactly (a 16-bit shift); the product of two bf16 values
//! is exact in f32 (8 × 8 significant bits), so only the adds round. Summation order as for F32: product `i`
//! into lane `i % 32`, lanes folded by [`super::reduce32`]; the AVX2 path (shift conversion,
//! 4 × 8 lanes) gives exactly the scalar bits.

use super::{reduce32, SimdLevel};

const SIZE: usize = 2;

pub(super) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (d, v) in dst.chunks_exact_mut(SIZE).zip(src) {
        d.copy_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes());
    }
}

pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(SIZE)) {
        *d = to_f32(u16::from_le_bytes([s[0], s[1]]));
    }
}

#[inline(always)]
fn to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

#[inline(always)]
fn weight(w: &[u8], i: usize) -> f32 {
    to_f32(u16::from_le_bytes([w[SIZE * i], w[SIZE * i + 1]]))
}

/// Dot of a row of bf16 weights (`w`, little-endian bytes) with bf16 activations `a` (bits).
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
            let p = unsafe { _mm256_mul_ps(bf16x8_to_f32(x), bf16x8_to_f32(y)) };
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

/// Widens 8 bf16 values to f32 (exact: the bits move up by 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bf16x8_to_f32(v: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16))
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    dot_kernel!(Bf16, BF16, Vec<u16>, |x| act_u16(GgmlType::BF16, x), bytes);

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Bf16>(&[(1, 1), (2, 31), (3, 32), (4, 333), (5, 4096)], 100);
    }

    #[test]
    fn scalar_is_close_to_f32_reference() {
        // The activation's bf16 rounding is 2^-8 relative.
        check_float_scalar_against_reference::<Bf16>(2f64.powi(-8));
    }

    #[test]
    fn round_trip_within_half_a_bf16_ulp() {
        let v = values(3, 1000, 1.0);
        for (x, y) in v.iter().zip(&round_trip(GgmlType::BF16, &v)) {
            assert!((x - y).abs() <= x.abs() * 2f32.powi(-8), "{x} {y}");
        }
    }
}
