//! The dot product of the float weight formats (F32, F16, BF16), written once.
//!
//! Why this exists: the three formats fix one and the same summation order — product `i` is
//! added to lane `i % 32`, the 32 lanes are folded by [`super::reduce32`], products are rounded
//! before the add (no FMA) — and differ only in how a weight or an activation value becomes an
//! f32 (always exactly). Each format supplies that conversion ([`FloatFormat`]); the loops, the
//! AVX2 path (4 × 8 lanes, the same bits as the scalar one) and the tail live here; the NEON
//! paths (8 × 4 lanes) in `float_dot/neon.rs`.

use super::reduce32;

#[cfg(target_arch = "aarch64")]
mod neon;

/// How one float format's weights and activations become f32 (exactly).
pub(super) trait FloatFormat {
    /// One activation value as the dot takes it (an f32, or f16/bf16 bits).
    type Act: Copy;
    /// Bytes of one weight.
    const SIZE: usize;

    /// The f32 value of activation `a`.
    fn act(a: Self::Act) -> f32;

    /// The f32 value of weight `i` of the little-endian row `w`.
    fn weight(w: &[u8], i: usize) -> f32;

    /// 8 values as loaded, before [`FloatFormat::widen8`] (an f32 vector, or 8 × 16 bits).
    #[cfg(target_arch = "x86_64")]
    type Raw8: Copy;

    /// Weights `i .. i + 8` of the row starting at `w`, as stored.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present, and the 8 weights lie inside the row.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_weights8(w: *const u8, i: usize) -> Self::Raw8;

    /// Activations `i .. i + 8` of the vector starting at `a`, as stored.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present, and the 8 values lie inside the vector.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load_acts8(a: *const Self::Act, i: usize) -> Self::Raw8;

    /// 8 loaded values as f32 (exactly).
    ///
    /// # Safety
    /// AVX2, FMA and F16C are present.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen8(v: Self::Raw8) -> std::arch::x86_64::__m256;
}

/// Dot of a row of `F` weights (`w`, little-endian bytes) with activations `a`, over
/// `min(a.len(), w.len() / SIZE)` values: the scalar reference.
pub(super) fn dot_scalar<F: FloatFormat>(w: &[u8], a: &[F::Act]) -> f32 {
    let n = a.len().min(w.len() / F::SIZE);
    let mut lanes = [0f32; 32];
    for i in 0..n {
        lanes[i % 32] += F::weight(w, i) * F::act(a[i]);
    }
    reduce32(&lanes)
}

/// [`dot_scalar`] with AVX2 (the same bits).
///
/// # Safety
/// AVX2, FMA and F16C are present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_avx2<F: FloatFormat>(w: &[u8], a: &[F::Act]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(w.len() / F::SIZE);
    let full = n / 32 * 32;
    let wp = w.as_ptr();
    let ap = a.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < full {
        for (k, acc_k) in acc.iter_mut().enumerate() {
            // SAFETY: i + 8k + 8 <= full <= n, inside both slices (the loads are unaligned).
            let x = unsafe { F::load_weights8(wp, i + 8 * k) };
            let y = unsafe { F::load_acts8(ap, i + 8 * k) };
            let p = unsafe { _mm256_mul_ps(F::widen8(x), F::widen8(y)) };
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
        lanes[i % 32] += F::weight(w, i) * F::act(a[i]);
    }
    reduce32(&lanes)
}
