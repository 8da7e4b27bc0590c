//! IQ4_XS: super-blocks of 256 values in 8 sub-blocks of 32, each value a 4-bit index into
//! IQ4_NL's table, each sub-block with a signed 6-bit scale under an f16 super-scale:
//! value = d · (ls − 32) · K[q]. A preset of its own and the 4.25-bit files of many large
//! MoE releases. Dotted against Q8_K activations.
//!
//! Layout (136 bytes): `d` (f16), `scales_h` (u16: bits `2i .. 2i + 2` are sub-block `i`'s top
//! two scale bits), `scales_l[4]` (nibble `i % 2` of byte `i / 2`: its low four), `qs[128]`:
//! sub-block `i` uses bytes `16i .. 16i + 16`, byte `16i + j` holding value `32i + j` (low
//! nibble) and `32i + 16 + j` (high nibble).
//!
//! Summation order (llama.cpp's x86 `ggml_vec_dot_iq4_xs_q8_K`, shared by every path): 8 lane
//! accumulators, one fused multiply-add per super-block each, `lane_k = fma(d·d_a, sumi_k,
//! lane_k)`, where `sumi_k` sums exactly, over the 8 sub-blocks, `(ls − 32) · Σ K[q]·a` over
//! values `4k .. 4k + 4` of the sub-block; folded by [`reduce8`] at the end.

#[cfg(target_arch = "aarch64")]
mod neon;

use super::iq4_nl::{fit_group, LEVELS, NEAREST};
use super::q8_k::{BlockQ8K, QK_K};
use super::{f16_to_f32, f32_to_f16, max_by_magnitude, nearest_int, reduce8, RawBlock};

/// One IQ4_XS super-block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockIq4Xs {
    d: [u8; 2],
    scales_h: [u8; 2],
    scales_l: [u8; QK_K / 64],
    qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIq4Xs>() == 136);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockIq4Xs {}

/// The 8 sub-block scales (−32..=31).
#[inline(always)]
fn scales(b: &BlockIq4Xs) -> [i32; 8] {
    let h = u16::from_le_bytes(b.scales_h);
    std::array::from_fn(|i| {
        let low = (b.scales_l[i / 2] >> (4 * (i % 2))) & 0x0F;
        let high = ((h >> (2 * i)) & 3) as u8;
        (low | (high << 4)) as i32 - 32
    })
}

/// The index of value `j` (< 32) of sub-block `i`.
#[inline(always)]
fn index(b: &BlockIq4Xs, i: usize, j: usize) -> usize {
    let byte = b.qs[16 * i + j % 16];
    (if j < 16 { byte & 0x0F } else { byte >> 4 }) as usize
}

pub(super) fn dequantize(src: &[BlockIq4Xs], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        for (i, (ls, ys)) in scales(b)
            .into_iter()
            .zip(y.chunks_exact_mut(32))
            .enumerate()
        {
            let dl = d * ls as f32;
            for (j, o) in ys.iter_mut().enumerate() {
                *o = dl * LEVELS[index(b, i, j)] as f32;
            }
        }
    }
}

/// Each sub-block fitted as IQ4_NL fits a block; the sub-block scales to signed 6 bits under
/// the f16 super-scale (the largest in magnitude to −32), then the indices chosen against the
/// stored scales.
pub(super) fn quantize(src: &[f32], dst: &mut [BlockIq4Xs]) {
    for (x, b) in src.chunks_exact(QK_K).zip(dst.iter_mut()) {
        let fits: [f32; 8] = std::array::from_fn(|i| fit_group(&x[32 * i..32 * i + 32]));
        let max_scale = max_by_magnitude(&fits);
        let iscale = if max_scale != 0.0 {
            -32.0 / max_scale
        } else {
            0.0
        };
        b.d = f32_to_f16(if iscale != 0.0 { 1.0 / iscale } else { 0.0 });
        let d = f16_to_f32(b.d);
        let mut h = 0u16;
        b.scales_l = [0; QK_K / 64];
        for (i, f) in fits.iter().enumerate() {
            let ls = (nearest_int(iscale * f).clamp(-32, 31) + 32) as u8;
            b.scales_l[i / 2] |= (ls & 0x0F) << (4 * (i % 2));
            h |= ((ls >> 4) as u16) << (2 * i);
            let dl = d * (ls as i32 - 32) as f32;
            for j in 0..16 {
                let q = |v: f32| {
                    if dl != 0.0 {
                        NEAREST.index(v / dl) as u8
                    } else {
                        8
                    }
                };
                b.qs[16 * i + j] = q(x[32 * i + j]) | (q(x[32 * i + 16 + j]) << 4);
            }
        }
        b.scales_h = h.to_le_bytes();
    }
}

pub(super) fn dot_scalar(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
    let mut lanes = [0f32; 8];
    for (x, y) in w.iter().zip(a) {
        let d = f16_to_f32(x.d) * y.d;
        let mut sumi = [0i32; 8];
        for (i, ls) in scales(x).into_iter().enumerate() {
            for (k, s) in sumi.iter_mut().enumerate() {
                let p: i32 = (4 * k..4 * k + 4)
                    .map(|j| LEVELS[index(x, i, j)] as i32 * y.qs[32 * i + j] as i32)
                    .sum();
                *s += ls * p;
            }
        }
        for (l, s) in lanes.iter_mut().zip(sumi) {
            *l = d.mul_add(s as f32, *l);
        }
    }
    reduce8(&lanes)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
    use super::block32::x86::{lookup, nibbles};
    use super::q8_k::x86::fold;
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    for (x, y) in w.iter().zip(a) {
        // SAFETY: F16C is present.
        let d = unsafe { super::f16c(x.d) } * y.d;
        let mut sumi = _mm256_setzero_si256();
        for (i, ls) in scales(x).into_iter().enumerate() {
            // SAFETY: AVX2 is present; 16 weight bytes at 16i and 32 activation bytes at 32i,
            // i < 8.
            let p16 = unsafe {
                let qs: &[u8; 16] = &*x.qs.as_ptr().add(16 * i).cast();
                let q = lookup(&LEVELS, nibbles(qs));
                let yv = _mm256_loadu_si256(y.qs.as_ptr().add(32 * i).cast());
                // Pairs of signed products (|q|, |a| ≤ 127: ≤ 2 · 127² per i16, exact).
                _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(yv, q))
            };
            // Pairs of pairs times the scale: |4 · 127² · 32| per sub-block, 8 of them: < 2^31.
            let p = _mm256_madd_epi16(p16, _mm256_set1_epi16(ls as i16));
            sumi = _mm256_add_epi32(sumi, p);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    // SAFETY: AVX2 is present.
    unsafe { fold(acc) }
}

super::format::kquant_format!(Iq4Xs, IQ4_XS, BlockIq4Xs);

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Iq4Xs>(&[(1, 1), (2, 3), (3, 16)], 50);
    }

    /// Grouped on aarch64 from dotprod (each block's levels looked up once); x86-64 has no
    /// grouped kernel.
    #[test]
    fn group_dot_matches_single_dots_bits() {
        #[cfg(target_arch = "aarch64")]
        let grouped = super::super::simd_level() >= super::super::SimdLevel::Dotprod;
        #[cfg(not(target_arch = "aarch64"))]
        let grouped = false;
        check_group_matches_single::<Iq4Xs>(grouped);
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Iq4Xs>(&[241, 242, 243]);
    }

    /// ggml's per-value decoding, written out from the layout.
    #[test]
    fn dequantize_follows_the_layout() {
        let raw = bytes(14, 136 * 2);
        let got = dequantized(GgmlType::IQ4_XS, &raw);
        for (b, y) in raw.chunks(136).zip(got.chunks(256)) {
            let d = f16_to_f32([b[0], b[1]]);
            let h = u16::from_le_bytes([b[2], b[3]]);
            for i in 0..8 {
                let ls = ((b[4 + i / 2] >> (4 * (i % 2))) & 15) as i32
                    | (((h >> (2 * i)) & 3) as i32) << 4;
                let dl = d * (ls - 32) as f32;
                for j in 0..16 {
                    let byte = b[8 + 16 * i + j];
                    let (lo, hi) = (LEVELS[(byte & 15) as usize], LEVELS[(byte >> 4) as usize]);
                    assert_eq!(y[32 * i + j].to_bits(), (dl * lo as f32).to_bits());
                    assert_eq!(y[32 * i + 16 + j].to_bits(), (dl * hi as f32).to_bits());
                }
            }
        }
    }

    #[test]
    fn round_trip_error_within_budget() {
        // IQ4_NL's error plus the 6-bit sub-block scales'.
        let rel = relative_rms_error(GgmlType::IQ4_XS, &values(9, QK_K * 64, 1.0));
        assert!(rel < 0.1, "relative rmse {rel}");
        let flat = round_trip(GgmlType::IQ4_XS, &[0.0; QK_K]);
        assert!(flat.iter().all(|v| *v == 0.0));
    }
}
