//! F32 weights against f32 activations (norm weights, routers, small dense tensors).
//!
//! Summation order (shared by every path, and by F16 and BF16: [`super::float_dot`]): product
//! `i` is added to lane `i % 32`; the 32 lanes are folded by [`super::reduce32`]. Products are
//! rounded before the add (no FMA), so the AVX2 path (4 × 8 lanes) gives exactly the scalar
//! bits.

use super::float_dot::{self, FloatFormat};
#[cfg(target_arch = "x86_64")]
use super::format::Kernel;
use super::format::{Activation, Format};
use super::{ActBuf, ActFormat};
use crate::gguf::GgmlType;

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

/// F32 as the shared float dot reads it.
pub(crate) struct F32;

impl FloatFormat for F32 {
    type Act = f32;
    const SIZE: usize = SIZE;

    #[inline(always)]
    fn act(a: f32) -> f32 {
        a
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

    #[cfg(target_arch = "x86_64")]
    type Raw8 = std::arch::x86_64::__m256;

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load_weights8(w: *const u8, i: usize) -> Self::Raw8 {
        // SAFETY: the caller keeps the 8 values inside the row (unaligned load).
        unsafe { std::arch::x86_64::_mm256_loadu_ps(w.cast::<f32>().add(i)) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load_acts8(a: *const Self::Act, i: usize) -> Self::Raw8 {
        // SAFETY: the caller keeps the 8 values inside the vector (unaligned load).
        unsafe { std::arch::x86_64::_mm256_loadu_ps(a.add(i)) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn widen8(v: Self::Raw8) -> std::arch::x86_64::__m256 {
        v
    }
}

/// F32 activations, as they are.
pub(crate) struct ActF32;

impl Activation for ActF32 {
    const FORMAT: ActFormat = ActFormat::F32;
    const BLOCK: usize = 1;
    type View = [f32];

    fn prepare(x: &[f32], buf: &mut ActBuf) {
        buf.f32s.clear();
        buf.f32s.extend_from_slice(x);
    }

    fn view(buf: &ActBuf) -> &[f32] {
        &buf.f32s
    }
}

impl Format for F32 {
    const TY: GgmlType = GgmlType::F32;
    type Block = [u8; SIZE];
    type Act = ActF32;

    fn quantize(src: &[f32], dst: &mut [[u8; SIZE]]) {
        quantize(src, dst.as_flattened_mut())
    }

    fn dequantize(src: &[[u8; SIZE]], dst: &mut [f32]) {
        dequantize(src.as_flattened(), dst)
    }

    fn dot(w: &[[u8; SIZE]], a: &[f32]) -> f32 {
        float_dot::dot_scalar::<F32>(w.as_flattened(), a)
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel<F32> for super::format::Avx2 {
    unsafe fn dot(w: &[[u8; SIZE]], a: &[f32]) -> f32 {
        // SAFETY: the caller's (AVX2, FMA and F16C are present).
        unsafe { float_dot::dot_avx2::<F32>(w.as_flattened(), a) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<F32>(&[(1, 1), (2, 31), (3, 32), (4, 333), (5, 4096)], 100);
    }

    /// Every level's `dot_rows` (two rows a step on aarch64) gives each row the scalar bits.
    #[test]
    fn rows_match_scalar() {
        super::super::block32::checks::check_rows_match_scalar::<F32>();
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
