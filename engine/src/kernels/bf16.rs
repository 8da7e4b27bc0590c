//! BF16 weights against bf16 activations (as llama.cpp's CPU backend converts the activation to
//! the weight's type before the dot).
//!
//! Both operands are converted to f32 exactly (a 16-bit shift); the product of two bf16 values is
//! exact in f32 (8 × 8 significant bits), so only the adds round. Summation order as for F32 (one
//! shared loop, [`super::float_dot`]): product `i` into lane `i % 32`, lanes folded by
//! [`super::reduce32`]; the AVX2 path (shift conversion, 4 × 8 lanes) gives exactly the scalar
//! bits.

use super::float_dot::{self, FloatFormat};
#[cfg(target_arch = "x86_64")]
use super::format::Kernel;
use super::format::{Activation, Format};
use super::{ActBuf, ActFormat};
use crate::gguf::GgmlType;

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

/// BF16 as the shared float dot reads it.
pub(crate) struct Bf16;

impl FloatFormat for Bf16 {
    type Act = u16;
    const SIZE: usize = SIZE;

    #[inline(always)]
    fn act(a: u16) -> f32 {
        to_f32(a)
    }

    #[inline(always)]
    fn weight(w: &[u8], i: usize) -> f32 {
        to_f32(u16::from_le_bytes([w[SIZE * i], w[SIZE * i + 1]]))
    }

    #[cfg(target_arch = "x86_64")]
    type Raw8 = std::arch::x86_64::__m128i;

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load_weights8(w: *const u8, i: usize) -> Self::Raw8 {
        // SAFETY: the caller keeps the 8 values inside the row (unaligned load).
        unsafe { std::arch::x86_64::_mm_loadu_si128(w.cast::<u16>().add(i).cast()) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load_acts8(a: *const Self::Act, i: usize) -> Self::Raw8 {
        // SAFETY: the caller keeps the 8 values inside the vector (unaligned load).
        unsafe { std::arch::x86_64::_mm_loadu_si128(a.add(i).cast()) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn widen8(v: Self::Raw8) -> std::arch::x86_64::__m256 {
        unsafe { bf16x8_to_f32(v) }
    }
}

/// Bf16 activations (bits), rounded to nearest even from f32.
pub(crate) struct ActBf16;

impl Activation for ActBf16 {
    const FORMAT: ActFormat = ActFormat::Bf16;
    const BLOCK: usize = 1;
    type View = [u16];

    fn prepare(x: &[f32], buf: &mut ActBuf) {
        buf.u16s.clear();
        buf.u16s
            .extend(x.iter().map(|v| half::bf16::from_f32(*v).to_bits()));
    }

    fn view(buf: &ActBuf) -> &[u16] {
        &buf.u16s
    }
}

impl Format for Bf16 {
    const TY: GgmlType = GgmlType::BF16;
    type Block = [u8; SIZE];
    type Act = ActBf16;

    fn quantize(src: &[f32], dst: &mut [[u8; SIZE]]) {
        quantize(src, dst.as_flattened_mut())
    }

    fn dequantize(src: &[[u8; SIZE]], dst: &mut [f32]) {
        dequantize(src.as_flattened(), dst)
    }

    fn dot(w: &[[u8; SIZE]], a: &[u16]) -> f32 {
        float_dot::dot_scalar::<Bf16>(w.as_flattened(), a)
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel<Bf16> for super::format::Avx2 {
    unsafe fn dot(w: &[[u8; SIZE]], a: &[u16]) -> f32 {
        // SAFETY: the caller's (AVX2, FMA and F16C are present).
        unsafe { float_dot::dot_avx2::<Bf16>(w.as_flattened(), a) }
    }
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
