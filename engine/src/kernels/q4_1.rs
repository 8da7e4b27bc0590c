//! Q4_1: blocks of 32 4-bit levels with an f16 scale and an f16 offset,
//! value = d · q + m (q in 0..=15). The fallback `llama-quantize` writes for Q4_0 files' first
//! `ffn_down` layers with an importance matrix, and a preset of its own. Dotted against Q8_0
//! activations with llama.cpp's Q8_1 sum term (`s = d_a · Σ a`), order [`Order::LanesOffset`].
//!
//! Layout (20 bytes): `d`, `m` (f16), `qs[16]`: byte `j` holds level `j` (low nibble) and
//! level `j + 16` (high nibble).

use super::block32::{self, block32_format, nibble, pack_nibbles, Block32, Order, Scale, QK};
use super::{f16_to_f32, f32_to_f16, nearest_int, RawBlock};

/// One Q4_1 block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ4_1 {
    d: [u8; 2],
    m: [u8; 2],
    qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ4_1 {}

impl Block32 for BlockQ4_1 {
    const ORDER: Order = Order::LanesOffset;

    #[inline]
    fn levels(&self) -> [i8; QK] {
        std::array::from_fn(|i| nibble(&self.qs, i) as i8)
    }

    #[inline]
    fn scale_raw(&self) -> Scale {
        Scale::F16(self.d)
    }

    #[inline]
    fn offset_raw(&self) -> [u8; 2] {
        self.m
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels_avx2(&self) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's (AVX2 is present).
        unsafe { block32::x86::nibbles(&self.qs) }
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    fn levels_neon(&self) -> [std::arch::aarch64::int8x16_t; 2] {
        use std::arch::aarch64::vreinterpretq_s8_u8;
        let q = block32::neon::levels::nibbles(&self.qs);
        // SAFETY: base Advanced SIMD, register-only.
        unsafe { q.map(|v| vreinterpretq_s8_u8(v)) }
    }
}

/// Min-max quantizer with `n_max + 1` levels over [min, max] of each block (Q4_1: 15, Q5_1:
/// 31); the levels are chosen against the stored (f16) scale and offset. Returns (d, m,
/// levels) per block.
pub(super) fn quantize_min_max(x: &[f32], n_max: u8) -> ([u8; 2], [u8; 2], [u8; QK]) {
    let min = x.iter().fold(f32::INFINITY, |a, v| a.min(*v));
    let max = x.iter().fold(f32::NEG_INFINITY, |a, v| a.max(*v));
    let (min, max) = if min <= max { (min, max) } else { (0.0, 0.0) };
    let d = f32_to_f16((max - min) / n_max as f32);
    let m = f32_to_f16(min);
    let (d_f, m_f) = (f16_to_f32(d), f16_to_f32(m));
    let id = if d_f != 0.0 { 1.0 / d_f } else { 0.0 };
    let levels =
        std::array::from_fn(|i| nearest_int((x[i] - m_f) * id).clamp(0, n_max as i32) as u8);
    (d, m, levels)
}

pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ4_1]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let (d, m, levels) = quantize_min_max(x, 15);
        *b = BlockQ4_1 {
            d,
            m,
            qs: pack_nibbles(&levels),
        };
    }
}

block32_format!(Q4_1, Q4_1, BlockQ4_1, quantize);

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    #[test]
    fn rows_match_scalar_bits() {
        super::super::block32::checks::check_rows_match_scalar::<Q4_1>();
    }

    /// Grouped dots on aarch64 (each weight block unpacked once for the group's tokens).
    #[test]
    fn group_matches_single_bits() {
        check_group_matches_single::<Q4_1>(cfg!(target_arch = "aarch64"));
    }

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Q4_1>(&[(1, 1), (2, 7), (3, 8), (4, 19), (5, 128)], 50);
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Q4_1>(&[141, 142, 143]);
    }

    /// ggml's per-value decoding: `d · nibble + m`, nibble `j` low, `j + 16` high.
    #[test]
    fn dequantize_follows_the_layout() {
        let raw = bytes(7, 20 * 3);
        let got = dequantized(GgmlType::Q4_1, &raw);
        for (b, y) in raw.chunks(20).zip(got.chunks(32)) {
            let d = f16_to_f32([b[0], b[1]]);
            let m = f16_to_f32([b[2], b[3]]);
            for j in 0..16 {
                let (lo, hi) = ((b[4 + j] & 15) as f32, (b[4 + j] >> 4) as f32);
                assert_eq!(y[j].to_bits(), (d * lo + m).to_bits());
                assert_eq!(y[j + 16].to_bits(), (d * hi + m).to_bits());
            }
        }
    }

    #[test]
    fn round_trip_error_within_budget() {
        // 16 levels over each block's range: rmse ≈ range/15/√12 ≈ 0.07σ for these values.
        let rel = relative_rms_error(GgmlType::Q4_1, &values(9, QK * 64, 1.0));
        assert!(rel < 0.1, "relative rmse {rel}");
        let flat = round_trip(GgmlType::Q4_1, &[0.25; QK]);
        assert!(flat.iter().all(|v| (v - 0.25).abs() < 1e-3), "{flat:?}");
    }
}
