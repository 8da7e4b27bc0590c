//! F32 weights against f32 activations (norm weights, routers, small dense tensors).
//!
//! Summation order (shared by every path): product `i` is added to lane `i % 32`; the 32 lanes
//! are folded by [`super::reduce32`]. Products are rounded before the add (no FMA), so the AVX2
//! path (4 × 8 lanes) gives exactly the scalar bits.

use super::{reduce32, SimdLevel};

/// Bytes of one value.
const SIZE: usize = 4;

pub(super) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (d, v) in dst.chunks_exact_mut(SIZE).zip(src) {
        d.copy_from_slice(&v.to_le_bytes());
    }
}

pub(super) fn dequantize(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(SIZE)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

#[inline(always)]
fn weight(w: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([
        w[SIZE * i],
        w[SIZE * i + 1],
        w[SIZE * i + 2],
        w[SIZE * i + 3],
    ])
}

/// Dot of a row of `a.len()` f32 weights (`w`, little-endian bytes) with `a`.
pub(super) fn dot(level: SimdLevel, w: &[u8], a: &[f32]) -> f32 {
    simd_dispatch!(level, dot_avx2(w, a), dot_scalar(w, a))
}

pub(super) fn dot_scalar(w: &[u8], a: &[f32]) -> f32 {
    let n = a.len().min(w.len() / SIZE);
    let mut lanes = [0f32; 32];
    for i in 0..n {
        lanes[i % 32] += weight(w, i) * a[i];
    }
    reduce32(&lanes)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(w: &[u8], a: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(w.len() / SIZE);
    let full = n / 32 * 32;
    let wp = w.as_ptr().cast::<f32>();
    let ap = a.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < full {
        for (k, acc_k) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8k + 8 <= full <= n, inside both slices; unaligned loads.
            let x = unsafe { _mm256_loadu_ps(wp.add(i + 8 * k)) };
            let y = unsafe { _mm256_loadu_ps(ap.add(i + 8 * k)) };
            *acc_k = _mm256_add_ps(*acc_k, _mm256_mul_ps(x, y));
        }
        i += 32;
    }
    let mut lanes = [0f32; 32];
    for (k, acc_k) in acc.iter().enumerate() {
        // SAFETY: lanes has room for 8 floats at 8k.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * k), *acc_k) };
    }
    for i in full..n {
        lanes[i % 32] += weight(w, i) * a[i];
    }
    reduce32(&lanes)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    dot_kernel!(F32, F32, Vec<f32>, |x: &[f32]| x.to_vec(), bytes);

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<F32>(&[(1, 1), (2, 31), (3, 32), (4, 333), (5, 4096)], 100);
    }

    #[test]
    fn scalar_is_close_to_f64_reference() {
        // Products and adds round in f32; the activation is exact.
        check_float_scalar_against_reference::<F32>(0.0);
    }

    #[test]
    fn round_trip_is_exact() {
        let v = values(3, 100, 1.0);
        assert_eq!(round_trip(GgmlType::F32, &v), v);
    }
}
