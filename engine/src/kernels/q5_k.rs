//! Q5_K: like Q4_K with a fifth bit per value (levels 0..=31): value = d · sc_j · q − dmin · m_j.
//! Used for attention output in Q4_K_M files. Dotted against Q8_K activations.
//!
//! Layout (176 bytes): `d`, `dmin` (f16), `scales[12]` (as Q4_K), `qh[32]`, `qs[128]`. Chunk `c`
//! of `qs` holds the low 4 bits of values `64c .. 64c + 32` (low nibbles) and `64c + 32 ..
//! 64c + 64` (high nibbles); the fifth bit of value `64c + l` is bit `2c` of `qh[l]`, of value
//! `64c + 32 + l` bit `2c + 1`.
//!
//! Summation order (llama.cpp's x86 `ggml_vec_dot_q5_K_q8_K`, shared by every path): 8 lane
//! accumulators, one fused multiply-add per super-block each, `lane_k = fma(d_a·d, sumi_k,
//! lane_k)`, where `sumi_k` sums exactly, over the 8 groups of 32 values, `sc · Σ q·a` over
//! values `4k .. 4k + 4` of the group; beside them one fused chain of the minimums' terms,
//! `m_sum = fma(−d_a·dmin, Σ_j m_j·(bsum_2j + bsum_2j+1), m_sum)`; the result
//! `reduce8(lanes) + m_sum`. SIMD only computes the integers and the same lane steps, so it
//! matches the scalar bits.

#[cfg(target_arch = "aarch64")]
mod neon;

use super::q4_k::{mins_dot, quantize_super_block, unpack_scales};
use super::q8_k::{BlockQ8K, QK_K};
use super::{f16_to_f32, reduce8, RawBlock};

/// One Q5_K super-block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ5K {
    d: [u8; 2],
    dmin: [u8; 2],
    scales: [u8; 12],
    qh: [u8; QK_K / 8],
    qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);

impl BlockQ5K {
    /// `d`, `dmin` and `scales`: the first 16 bytes.
    #[cfg(target_arch = "x86_64")]
    fn head(&self) -> &[u8; 16] {
        // SAFETY: repr(C) with alignment 1; the block is 176 bytes, so its first 16 bytes are
        // in bounds and any bits are valid for u8.
        unsafe { &*(self as *const Self).cast::<[u8; 16]>() }
    }
}
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ5K {}

pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ5K]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
        let k = quantize_super_block(x, 31);
        b.d = k.d;
        b.dmin = k.dmin;
        b.scales = k.scales;
        b.qh = [0; QK_K / 8];
        for c in 0..4 {
            for l in 0..32 {
                let lo = k.levels[64 * c + l];
                let hi = k.levels[64 * c + 32 + l];
                b.qs[32 * c + l] = (lo & 0x0F) | ((hi & 0x0F) << 4);
                b.qh[l] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1));
            }
        }
    }
}

/// The 5-bit levels of chunk `c`: (value `64c + l`, value `64c + 32 + l`).
#[inline(always)]
fn levels(b: &BlockQ5K, c: usize, l: usize) -> (u8, u8) {
    let q = b.qs[32 * c + l];
    let h = b.qh[l];
    (
        (q & 0x0F) | (((h >> (2 * c)) & 1) << 4),
        (q >> 4) | (((h >> (2 * c + 1)) & 1) << 4),
    )
}

pub(super) fn dequantize(src: &[BlockQ5K], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let dmin = f16_to_f32(b.dmin);
        let (sc, m) = unpack_scales(&b.scales);
        for c in 0..4 {
            let (d1, m1) = (d * sc[2 * c] as f32, dmin * m[2 * c] as f32);
            let (d2, m2) = (d * sc[2 * c + 1] as f32, dmin * m[2 * c + 1] as f32);
            for l in 0..32 {
                let (lo, hi) = levels(b, c, l);
                y[64 * c + l] = d1 * lo as f32 - m1;
                y[64 * c + 32 + l] = d2 * hi as f32 - m2;
            }
        }
    }
}

super::format::kquant_format!(Q5K, Q5_K, BlockQ5K, grouped);

pub(super) fn dot_scalar(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut m_sum = 0f32;
    for (x, y) in w.iter().zip(a) {
        let (sc, m) = unpack_scales(&x.scales);
        let mut sumi = [0i32; 8];
        for c in 0..4 {
            for (k, s) in sumi.iter_mut().enumerate() {
                let (mut lo, mut hi) = (0i32, 0i32);
                for l in 4 * k..4 * k + 4 {
                    let (ql, qh) = levels(x, c, l);
                    lo += ql as i32 * y.qs[64 * c + l] as i32;
                    hi += qh as i32 * y.qs[64 * c + 32 + l] as i32;
                }
                *s += sc[2 * c] as i32 * lo + sc[2 * c + 1] as i32 * hi;
            }
        }
        let d = y.d * f16_to_f32(x.d);
        let dmin = -y.d * f16_to_f32(x.dmin);
        m_sum = dmin.mul_add(mins_dot(&m, &y.bsums) as f32, m_sum);
        for (l, s) in lanes.iter_mut().zip(sumi) {
            *l = d.mul_add(s as f32, *l);
        }
    }
    reduce8(&lanes) + m_sum
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    let [v] = unsafe { dot_n_avx2::<1>(w, [a]) };
    v
}

/// `N` dots of one row at once (see Q4_K's `dot_n_avx2`): the 5-bit values and scales are
/// built once per chunk; each activation keeps its own exact lane sums and float steps, the
/// same for any `N`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_n_avx2<const N: usize>(w: &[BlockQ5K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    use super::q4_k::x86;
    use std::arch::x86_64::*;
    let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut m_sum = [0f32; N];
    for (i, x) in w[..n].iter().enumerate() {
        let (scales, m) = unsafe { x86::scales_mins(x.head()) };
        // SAFETY: qh is 32 bytes.
        let mut hbits = unsafe { _mm256_loadu_si256(x.qh.as_ptr().cast()) };
        let mut sumi = [_mm256_setzero_si256(); N];
        for c in 0..4 {
            // SAFETY: 32-byte load inside qs (128 bytes).
            let q = unsafe { _mm256_loadu_si256(x.qs.as_ptr().add(32 * c).cast()) };
            // hbits has been shifted right by 2c: bit 0 / bit 1 of each byte are this
            // chunk's fifth bits (16-bit shifts carry across bytes, the masks drop that).
            let h_lo = _mm256_slli_epi16(_mm256_and_si256(hbits, one), 4);
            let h_hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 1), one), 4);
            let lo = _mm256_or_si256(_mm256_and_si256(q, m4), h_lo);
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), h_hi);
            let (sc_lo, sc_hi) = unsafe {
                (
                    x86::scale_of(scales, 2 * c),
                    x86::scale_of(scales, 2 * c + 1),
                )
            };
            for (t, s) in sumi.iter_mut().enumerate() {
                let y = &a[t][i];
                // SAFETY: 32-byte loads inside y.qs (256 bytes).
                let (ylo, yhi) = unsafe {
                    (
                        _mm256_loadu_si256(y.qs.as_ptr().add(64 * c).cast()),
                        _mm256_loadu_si256(y.qs.as_ptr().add(64 * c + 32).cast()),
                    )
                };
                // ≤ 2 · 31 · 127 per i16 lane: no saturation.
                let plo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ylo), sc_lo);
                let phi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, yhi), sc_hi);
                *s = _mm256_add_epi32(*s, _mm256_add_epi32(plo, phi));
            }
            hbits = _mm256_srli_epi16(hbits, 2);
        }
        // [d, dmin] of the weights, widened once for all activations.
        let dd = unsafe { x86::super_scales(x.d, x.dmin) };
        let (xd, xdmin) = (_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_movehdup_ps(dd)));
        for t in 0..N {
            let y = &a[t][i];
            let d = y.d * xd;
            let dmin = -y.d * xdmin;
            // SAFETY: AVX2 is present.
            let mins = unsafe { x86::mins_dot(m, &y.bsums) };
            m_sum[t] = dmin.mul_add(mins as f32, m_sum[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    // SAFETY: AVX2 is present.
    std::array::from_fn(|t| unsafe { super::q8_k::x86::fold(acc[t]) } + m_sum[t])
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Q5K>(&[(1, 1), (2, 3), (3, 16)], 50);
    }

    /// Grouped from AVX2 on x86-64 and from dotprod on aarch64.
    #[test]
    fn group_dot_matches_single_dots_bits() {
        #[cfg(target_arch = "aarch64")]
        let grouped = super::super::simd_level() >= super::super::SimdLevel::Dotprod;
        #[cfg(not(target_arch = "aarch64"))]
        let grouped = true;
        check_group_matches_single::<Q5K>(grouped);
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Q5K>(&[51, 52, 53]);
    }

    #[test]
    fn round_trip_error_within_budget() {
        // 32 levels: half Q4_K's step, so about half its error.
        let rel = relative_rms_error(GgmlType::Q5_K, &values(9, QK_K * 64, 1.0));
        assert!(rel < 0.055, "relative rmse {rel}");
    }
}
