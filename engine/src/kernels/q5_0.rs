//! Q5_0: blocks of 32 5-bit levels with an f16 scale, value = d · (q − 16). `llama-quantize`
//! writes it for rows Q4_K cannot hold (a length not a multiple of 256: Q4_K_M files of models
//! with such expert widths are full of it), and as a preset. Dotted against Q8_0 activations,
//! order [`Order::Lanes`].
//!
//! Layout (22 bytes): `d` (f16), `qh[4]` (a little-endian word: bit `i` is level `i`'s fifth
//! bit), `qs[16]` (the low 4 bits: level `j` low nibble, `j + 16` high nibble of byte `j`).

use super::block32::{self, block32_format, Block32, Order, Scale, QK};
use super::q5_1::{level5, pack5};
use super::{f16_to_f32, f32_to_f16, max_by_magnitude, nearest_int, RawBlock};

/// One Q5_0 block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ5_0 {
    d: [u8; 2],
    qh: [u8; 4],
    qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ5_0 {}

impl Block32 for BlockQ5_0 {
    const ORDER: Order = Order::Lanes;

    #[inline]
    fn levels(&self) -> [i8; QK] {
        std::array::from_fn(|i| level5(self.qh, &self.qs, i) as i8 - 16)
    }

    #[inline]
    fn scale_raw(&self) -> Scale {
        Scale::F16(self.d)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // SAFETY: the caller's (AVX2 is present).
        unsafe {
            let q = _mm256_or_si256(
                block32::x86::nibbles(&self.qs),
                block32::x86::fifth_bits(self.qh),
            );
            _mm256_sub_epi8(q, _mm256_set1_epi8(16))
        }
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    fn levels_neon(&self) -> [std::arch::aarch64::int8x16_t; 2] {
        use block32::neon::levels;
        /// 0xF0 where the fifth bit is clear: `nibble | 0xF0` is `nibble − 16` as a signed
        /// byte, `nibble | 0` is `(nibble + 16) − 16`.
        static SPREAD: [u64; 256] = levels::spread_table(0, 0xF0);
        levels::five(&self.qs, self.qh, &SPREAD)
    }
}

/// Absmax quantizer: the value of largest magnitude maps to −16 (as Q4_0 maps it to −8); the
/// levels are chosen against the stored (f16) scale.
pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ5_0]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let d = f32_to_f16(max_by_magnitude(x) / -16.0);
        let d_f = f16_to_f32(d);
        let id = if d_f != 0.0 { 1.0 / d_f } else { 0.0 };
        let levels = std::array::from_fn(|i| (nearest_int(x[i] * id).clamp(-16, 15) + 16) as u8);
        let (qh, qs) = pack5(&levels);
        *b = BlockQ5_0 { d, qh, qs };
    }
}

block32_format!(Q5_0, Q5_0, BlockQ5_0, quantize);

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    #[test]
    fn rows_match_scalar_bits() {
        super::super::block32::checks::check_rows_match_scalar::<Q5_0>();
    }

    /// Grouped dots on aarch64 (each weight block unpacked once for the group's tokens).
    #[test]
    fn group_matches_single_bits() {
        check_group_matches_single::<Q5_0>(cfg!(target_arch = "aarch64"));
    }

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Q5_0>(&[(1, 1), (2, 7), (3, 8), (4, 19), (5, 128)], 50);
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Q5_0>(&[131, 132, 133]);
    }

    /// ggml's per-value decoding: `d · ((nibble | fifth bit << 4) − 16)`.
    #[test]
    fn dequantize_follows_the_layout() {
        let raw = bytes(9, 22 * 3);
        let got = dequantized(GgmlType::Q5_0, &raw);
        for (b, y) in raw.chunks(22).zip(got.chunks(32)) {
            let d = f16_to_f32([b[0], b[1]]);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..16 {
                let lo = ((b[6 + j] & 15) as u32 | ((qh >> j) & 1) << 4) as i32 - 16;
                let hi = ((b[6 + j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4) as i32 - 16;
                assert_eq!(y[j].to_bits(), (d * lo as f32).to_bits());
                assert_eq!(y[j + 16].to_bits(), (d * hi as f32).to_bits());
            }
        }
    }

    #[test]
    fn round_trip_error_within_budget() {
        // Step amax/16: rmse ≈ step/√12 ≈ 0.07 of the block's absmax, ~0.05σ here.
        let rel = relative_rms_error(GgmlType::Q5_0, &values(9, QK * 64, 1.0));
        assert!(rel < 0.07, "relative rmse {rel}");
        let flat = round_trip(GgmlType::Q5_0, &[0.0; QK]);
        assert!(flat.iter().all(|v| *v == 0.0));
    }
}
