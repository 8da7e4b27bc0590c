//! MXFP4 (OCP microscaling FP4): blocks of 32 4-bit E2M1 floats under a shared power-of-two
//! scale, value = 2^(e − 127) · E2M1[q]. The expert format of gpt-oss. Dotted against Q8_0
//! activations, order [`Order::Pairs`] (llama.cpp's x86 `ggml_vec_dot_mxfp4_q8_0`).
//!
//! Layout (17 bytes): `e` (an E8M0 exponent byte), `qs[16]`: byte `j` holds value `j` (low
//! nibble) and value `j + 16` (high nibble). As ggml does, the table holds the E2M1 values
//! doubled (integers, so a dot stays in integers) and the scale is halved to match.

use super::block32::{
    self, block32_format, nibble, pack_nibbles, Block32, Nearest, Order, Scale, QK,
};
use super::RawBlock;

/// E2M1 values ×2: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (index 8 is −0).
pub(super) const LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// One MXFP4 block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockMxfp4 {
    e: u8,
    qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockMxfp4>() == 17);
// SAFETY: a byte and a byte array: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockMxfp4 {}

/// `2^(e − 127) / 2` exactly (ggml's `ggml_e8m0_to_fp32_half`): the scale of the doubled
/// table. Exponents 0 and 1 give the subnormals 2^-128 and 2^-127; 255 gives 2^127 (E8M0's
/// NaN code is not special-cased, as in ggml).
#[inline(always)]
pub(super) fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits((e as u32 - 1) << 23)
    }
}

/// [`e8m0_half`] of every exponent byte, as f32 bits: the NEON kernels' scale (one load where
/// the bit arithmetic takes five instructions and a move to the vector registers).
#[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
pub(super) static E8M0_HALF_BITS: [u32; 256] = {
    let mut t = [0u32; 256];
    let mut e = 0;
    while e < 256 {
        t[e] = if e < 2 {
            0x0020_0000 << e
        } else {
            (e as u32 - 1) << 23
        };
        e += 1;
    }
    t
};

impl Block32 for BlockMxfp4 {
    const ORDER: Order = Order::Pairs;

    #[inline]
    fn levels(&self) -> [i8; QK] {
        std::array::from_fn(|i| LEVELS[nibble(&self.qs, i) as usize])
    }

    #[inline]
    fn scale_raw(&self) -> Scale {
        Scale::E8m0Half(self.e)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels_avx2(&self) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's (AVX2 is present).
        unsafe { block32::x86::lookup(&LEVELS, block32::x86::nibbles(&self.qs)) }
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    fn levels_neon(&self) -> [std::arch::aarch64::int8x16_t; 2] {
        use block32::neon::levels;
        levels::lookup(&LEVELS, levels::nibbles(&self.qs))
    }
}

/// The table's levels in ascending order with their indices (for the nearest search).
const SORTED: [(f32, u8); 15] = [
    (-12.0, 15),
    (-8.0, 14),
    (-6.0, 13),
    (-4.0, 12),
    (-3.0, 11),
    (-2.0, 10),
    (-1.0, 9),
    (0.0, 0),
    (1.0, 1),
    (2.0, 2),
    (3.0, 3),
    (4.0, 4),
    (6.0, 5),
    (8.0, 6),
    (12.0, 7),
];

/// The shared exponent puts the block's largest magnitude near the top of the E2M1 range
/// (6 = 12 halves: `e = floor(log2(amax)) − 2 + 127`, as ggml picks it); the exponent one
/// above is also tried and the one with the smaller squared error kept. Each value then takes
/// the nearest level.
pub(super) fn quantize(src: &[f32], dst: &mut [BlockMxfp4]) {
    const NEAREST: Nearest = Nearest::new(&{
        let mut k = [0f32; 15];
        let mut i = 0;
        while i < 15 {
            k[i] = SORTED[i].0;
            i += 1;
        }
        k
    });
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let encode = |e: u8| -> ([u8; QK], f32) {
            let d = e8m0_half(e);
            let idx: [u8; QK] = std::array::from_fn(|i| SORTED[NEAREST.index(x[i] / d)].1);
            let err = x
                .iter()
                .zip(&idx)
                .map(|(v, &i)| (v - d * LEVELS[i as usize] as f32).powi(2))
                .sum();
            (idx, err)
        };
        let e = if amax > 0.0 && amax.is_finite() {
            (amax.log2().floor() as i32 - 2 + 127).clamp(0, 253) as u8
        } else {
            0
        };
        let (idx, e) = {
            let (a, ea) = encode(e);
            let (b, eb) = encode(e + 1);
            if eb < ea {
                (b, e + 1)
            } else {
                (a, e)
            }
        };
        *b = BlockMxfp4 {
            e,
            qs: pack_nibbles(&idx),
        };
    }
}

block32_format!(Mxfp4, MXFP4, BlockMxfp4, quantize);

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    /// The offset formats' activation terms (`s`) are never read: NaN there changes nothing.
    #[test]
    fn ignores_the_offset_terms() {
        let n = 7 * QK;
        let w = quantized_bytes(GgmlType::MXFP4, &values(3, n, 0.1));
        let mut act = prepared(GgmlType::MXFP4, &values(4, n, 1.0));
        let want = scalar_dot::<Mxfp4>(&w, &act);
        act.q8_0.s.iter_mut().for_each(|s| *s = [0x00, 0x7E]);
        for level in crate::kernels::SimdLevel::available() {
            let mut out = [f32::NAN; 1];
            // SAFETY: the level is available; one row.
            unsafe { (table_of::<Mxfp4>().at(level).rows)(&w, w.len(), 0..1, &act, &mut out) };
            assert_eq!(out[0].to_bits(), want.to_bits(), "{level:?}");
        }
    }

    #[test]
    fn rows_match_scalar_bits() {
        super::super::block32::checks::check_rows_match_scalar::<Mxfp4>();
    }

    /// Grouped dots on aarch64 (each weight block unpacked once for the group's tokens).
    #[test]
    fn group_matches_single_bits() {
        check_group_matches_single::<Mxfp4>(cfg!(target_arch = "aarch64"));
    }

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Mxfp4>(
            &[(1, 1), (2, 2), (3, 7), (4, 8), (5, 19), (6, 128)],
            50,
        );
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Mxfp4>(&[211, 212, 213]);
    }

    #[test]
    fn e8m0_half_is_half_of_two_to_the_e_minus_127() {
        assert_eq!(e8m0_half(127), 0.5);
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(2), 2f32.powi(-126));
        assert_eq!(e8m0_half(1), 2f32.powi(-127));
        assert_eq!(e8m0_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_half(255), 2f32.powi(127));
        for e in 0..=255u8 {
            assert_eq!(E8M0_HALF_BITS[e as usize], e8m0_half(e).to_bits(), "{e}");
        }
    }

    /// ggml's per-value decoding: `e8m0_half(e) · K[nibble]`.
    #[test]
    fn dequantize_follows_the_layout() {
        let raw = bytes(11, 17 * 3);
        let got = dequantized(GgmlType::MXFP4, &raw);
        for (b, y) in raw.chunks(17).zip(got.chunks(32)) {
            let d = e8m0_half(b[0]);
            for j in 0..16 {
                let (lo, hi) = (
                    LEVELS[(b[1 + j] & 15) as usize],
                    LEVELS[(b[1 + j] >> 4) as usize],
                );
                assert_eq!(y[j].to_bits(), (d * lo as f32).to_bits());
                assert_eq!(y[j + 16].to_bits(), (d * hi as f32).to_bits());
            }
        }
    }

    #[test]
    fn round_trip_error_within_budget() {
        // 15 distinct levels, coarse at the top (4, 6), under a power-of-two scale that can
        // miss the block's range by up to 2x: about Q4_0's error (gguf-py's reference
        // quantizer: 0.140 on values like these, Q4_0 0.131; measured 0.137 here).
        let rel = relative_rms_error(GgmlType::MXFP4, &values(9, QK * 64, 1.0));
        assert!(rel < 0.15, "relative rmse {rel}");
        let flat = round_trip(GgmlType::MXFP4, &[0.0; QK]);
        assert!(flat.iter().all(|v| *v == 0.0));
        // Powers of two times table values come back exactly.
        let exact: Vec<f32> = (0..QK).map(|i| [0.0, 0.25, -1.5, 3.0][i % 4]).collect();
        assert_eq!(round_trip(GgmlType::MXFP4, &exact), exact);
    }
}
