//! Q5_1: blocks of 32 5-bit levels with an f16 scale and an f16 offset,
//! value = d · q + m (q in 0..=31). `llama-quantize` writes it for rows Q5_K cannot hold (a
//! length not a multiple of 256), and as a preset. Dotted against Q8_0 activations with
//! llama.cpp's Q8_1 sum term, order [`Order::LanesOffset`].
//!
//! Layout (24 bytes): `d`, `m` (f16), `qh[4]` (a little-endian word: bit `i` is level `i`'s
//! fifth bit), `qs[16]` (the low 4 bits: level `j` low nibble, `j + 16` high nibble of byte
//! `j`).

use super::block32::{self, block32_format, nibble, pack_nibbles, Block32, Order, Scale, QK};
use super::q4_1::quantize_min_max;
use super::RawBlock;

/// One Q5_1 block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ5_1 {
    d: [u8; 2],
    m: [u8; 2],
    qh: [u8; 4],
    qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ5_1 {}

/// The 5-bit level `i` of a block's `qh` and `qs`.
#[inline(always)]
pub(super) fn level5(qh: [u8; 4], qs: &[u8; QK / 2], i: usize) -> u8 {
    nibble(qs, i) | (((u32::from_le_bytes(qh) >> i) & 1) as u8) << 4
}

/// `qh` and `qs` of 32 5-bit levels.
pub(super) fn pack5(levels: &[u8; QK]) -> ([u8; 4], [u8; QK / 2]) {
    let qh = (0..QK).fold(0u32, |h, i| h | (((levels[i] >> 4) & 1) as u32) << i);
    (qh.to_le_bytes(), pack_nibbles(levels))
}

impl Block32 for BlockQ5_1 {
    const ORDER: Order = Order::LanesOffset;

    #[inline]
    fn levels(&self) -> [i8; QK] {
        std::array::from_fn(|i| level5(self.qh, &self.qs, i) as i8)
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
        use std::arch::x86_64::_mm256_or_si256;
        // SAFETY: the caller's (AVX2 is present).
        unsafe {
            _mm256_or_si256(
                block32::x86::nibbles(&self.qs),
                block32::x86::fifth_bits(self.qh),
            )
        }
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    fn levels_neon(&self) -> [std::arch::aarch64::int8x16_t; 2] {
        use block32::neon::levels;
        /// 0x10 where the fifth bit is set: the level's bit 4.
        static SPREAD: [u64; 256] = levels::spread_table(0x10, 0);
        levels::five(&self.qs, self.qh, &SPREAD)
    }
}

pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ5_1]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let (d, m, levels) = quantize_min_max(x, 31);
        let (qh, qs) = pack5(&levels);
        *b = BlockQ5_1 { d, m, qh, qs };
    }
}

block32_format!(Q5_1, Q5_1, BlockQ5_1, quantize);

#[cfg(test)]
mod tests {
    use super::super::f16_to_f32;
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    #[test]
    fn rows_match_scalar_bits() {
        super::super::block32::checks::check_rows_match_scalar::<Q5_1>();
    }

    /// Grouped dots on aarch64 (each weight block unpacked once for the group's tokens).
    #[test]
    fn group_matches_single_bits() {
        check_group_matches_single::<Q5_1>(cfg!(target_arch = "aarch64"));
    }

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Q5_1>(&[(1, 1), (2, 7), (3, 8), (4, 19), (5, 128)], 50);
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Q5_1>(&[151, 152, 153]);
    }

    /// ggml's per-value decoding: the fifth bit of value `j` is bit `j` of the `qh` word.
    #[test]
    fn dequantize_follows_the_layout() {
        let raw = bytes(8, 24 * 3);
        let got = dequantized(GgmlType::Q5_1, &raw);
        for (b, y) in raw.chunks(24).zip(got.chunks(32)) {
            let d = f16_to_f32([b[0], b[1]]);
            let m = f16_to_f32([b[2], b[3]]);
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            for j in 0..16 {
                let lo = (b[8 + j] & 15) as u32 | ((qh >> j) & 1) << 4;
                let hi = (b[8 + j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
                assert_eq!(y[j].to_bits(), (d * lo as f32 + m).to_bits());
                assert_eq!(y[j + 16].to_bits(), (d * hi as f32 + m).to_bits());
            }
        }
    }

    #[test]
    fn round_trip_error_within_budget() {
        // 32 levels: half Q4_1's step.
        let rel = relative_rms_error(GgmlType::Q5_1, &values(9, QK * 64, 1.0));
        assert!(rel < 0.05, "relative rmse {rel}");
    }
}
