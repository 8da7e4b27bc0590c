//! F16 weights against f16 activations (as llama.cpp's CPU backend converts the activation to
//! the weight's type before the dot).
//!
//! Both operands are converted to f32 exactly; the product of two f16 values is exact in f32
//! (11 × 11 significant bits), so only the adds round. Summation order as for F32 (one shared loop,
//! [`super::float_dot`]): product `i` into lane `i % 32`, lanes folded by [`super::reduce32`]; the
//! AVX2 path (F16C conversion, 4 × 8 lanes) gives exactly the scalar bits.

use super::float_dot::{self, FloatFormat};
#[cfg(target_arch = "x86_64")]
use super::format::Kernel;
use super::format::{Activation, Format};
use super::{ActBuf, ActFormat};
use crate::gguf::GgmlType;

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

/// F16 as the shared float dot reads it.
pub(crate) struct F16;

impl FloatFormat for F16 {
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
        std::arch::x86_64::_mm256_cvtph_ps(v)
    }
}

/// F16 activations (bits), rounded to nearest even from f32.
pub(crate) struct ActF16;

impl Activation for ActF16 {
    const FORMAT: ActFormat = ActFormat::F16;
    const BLOCK: usize = 1;
    type View = [u16];

    fn prepare(x: &[f32], buf: &mut ActBuf) {
        buf.u16s.clear();
        buf.u16s
            .extend(x.iter().map(|v| half::f16::from_f32(*v).to_bits()));
    }

    fn view(buf: &ActBuf) -> &[u16] {
        &buf.u16s
    }
}

impl Format for F16 {
    const TY: GgmlType = GgmlType::F16;
    type Block = [u8; SIZE];
    type Act = ActF16;

    fn quantize(src: &[f32], dst: &mut [[u8; SIZE]]) {
        quantize(src, dst.as_flattened_mut())
    }

    fn dequantize(src: &[[u8; SIZE]], dst: &mut [f32]) {
        dequantize(src.as_flattened(), dst)
    }

    fn dot(w: &[[u8; SIZE]], a: &[u16]) -> f32 {
        float_dot::dot_scalar::<F16>(w.as_flattened(), a)
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel<F16> for super::format::Avx2 {
    unsafe fn dot(w: &[[u8; SIZE]], a: &[u16]) -> f32 {
        // SAFETY: the caller's (AVX2, FMA and F16C are present).
        unsafe { float_dot::dot_avx2::<F16>(w.as_flattened(), a) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

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
