//! IQ4_NL: blocks of 32 4-bit indices into a fixed non-linear table of 16 levels, with an f16
//! scale: value = d · K[q]. `llama-quantize` writes it as a preset and for rows the 256-value
//! IQ formats cannot hold. Dotted against Q8_0 activations, order [`Order::Pairs`] (llama.cpp's
//! x86 `ggml_vec_dot_iq4_nl_q8_0`).
//!
//! Layout (18 bytes): `d` (f16), `qs[16]`: byte `j` holds index `j` (low nibble) and index
//! `j + 16` (high nibble).

use super::block32::{
    self, block32_format, nibble, pack_nibbles, Block32, Nearest, Order, Scale, QK,
};
use super::{f16_to_f32, f32_to_f16, max_by_magnitude, RawBlock};

/// The 16 levels (ggml's `kvalues_iq4nl`): denser near zero, where weights are.
pub(super) const LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// One IQ4_NL block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockIq4Nl {
    d: [u8; 2],
    qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIq4Nl>() == 18);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockIq4Nl {}

impl Block32 for BlockIq4Nl {
    const ORDER: Order = Order::Pairs;

    #[inline]
    fn levels(&self) -> [i8; QK] {
        std::array::from_fn(|i| LEVELS[nibble(&self.qs, i) as usize])
    }

    #[inline]
    fn scale_raw(&self) -> Scale {
        Scale::F16(self.d)
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

/// The table as floats, and its nearest-level search.
pub(super) const LEVELS_F32: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = LEVELS[i] as f32;
        i += 1;
    }
    t
};
pub(super) const NEAREST: Nearest = Nearest::new(&LEVELS_F32);

/// The squared error of `x` as `scale · LEVELS[nearest]`.
fn error(x: &[f32], scale: f32) -> f32 {
    let inv = 1.0 / scale;
    x.iter()
        .map(|v| (v - scale * LEVELS_F32[NEAREST.index(v * inv)]).powi(2))
        .sum()
}

/// Fits one group of values to `scale · LEVELS[index]` (IQ4_NL blocks, IQ4_XS sub-blocks):
/// tries the scales that put the value of largest magnitude on either end of the table and a
/// few around them, keeps the one with the smallest squared error, then refits it by least
/// squares on its indices if that lowers the error. Returns the scale (0 for an all-zero
/// group).
pub(super) fn fit_group(x: &[f32]) -> f32 {
    let max = max_by_magnitude(x);
    if max == 0.0 {
        return 0.0;
    }
    let mut best = (f32::INFINITY, 0.0);
    for end in [LEVELS_F32[0], LEVELS_F32[15]] {
        for step in -2i32..=2 {
            let scale = max / end * (1.0 + step as f32 / 32.0);
            if scale != 0.0 && scale.is_finite() {
                let e = error(x, scale);
                if e < best.0 {
                    best = (e, scale);
                }
            }
        }
    }
    let inv = 1.0 / best.1;
    let (num, den) = x.iter().fold((0f32, 0f32), |(n, d), v| {
        let t = LEVELS_F32[NEAREST.index(v * inv)];
        (n + v * t, d + t * t)
    });
    let refit = if den > 0.0 { num / den } else { 0.0 };
    if refit != 0.0 && refit.is_finite() && error(x, refit) < best.0 {
        refit
    } else {
        best.1
    }
}

pub(super) fn quantize(src: &[f32], dst: &mut [BlockIq4Nl]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let d = f32_to_f16(fit_group(x));
        let d_f = f16_to_f32(d);
        // Indices against the stored scale, so dequantization sees what was chosen; index 8
        // (level 1, the one nearest zero) for an all-zero block.
        let idx: [u8; QK] = if d_f != 0.0 {
            std::array::from_fn(|i| NEAREST.index(x[i] / d_f) as u8)
        } else {
            [8; QK]
        };
        *b = BlockIq4Nl {
            d,
            qs: pack_nibbles(&idx),
        };
    }
}

block32_format!(Iq4Nl, IQ4_NL, BlockIq4Nl, quantize);

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::gguf::GgmlType;

    #[test]
    fn rows_match_scalar_bits() {
        super::super::block32::checks::check_rows_match_scalar::<Iq4Nl>();
    }

    /// Grouped dots on aarch64 (each weight block unpacked once for the group's tokens).
    #[test]
    fn group_matches_single_bits() {
        check_group_matches_single::<Iq4Nl>(cfg!(target_arch = "aarch64"));
    }

    #[test]
    fn simd_matches_scalar_bits() {
        // Odd and even block counts: the unpaired last block takes its own step.
        check_simd_matches_scalar::<Iq4Nl>(
            &[(1, 1), (2, 2), (3, 7), (4, 8), (5, 19), (6, 128)],
            50,
        );
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Iq4Nl>(&[201, 202, 203]);
    }

    /// ggml's per-value decoding: `d · K[nibble]`.
    #[test]
    fn dequantize_follows_the_layout() {
        let raw = bytes(10, 18 * 3);
        let got = dequantized(GgmlType::IQ4_NL, &raw);
        for (b, y) in raw.chunks(18).zip(got.chunks(32)) {
            let d = f16_to_f32([b[0], b[1]]);
            for j in 0..16 {
                let (lo, hi) = (
                    LEVELS[(b[2 + j] & 15) as usize],
                    LEVELS[(b[2 + j] >> 4) as usize],
                );
                assert_eq!(y[j].to_bits(), (d * lo as f32).to_bits());
                assert_eq!(y[j + 16].to_bits(), (d * hi as f32).to_bits());
            }
        }
    }

    #[test]
    fn nearest_index_picks_the_closest_level() {
        for (v, want) in [
            (-200.0, 0),
            (-127.0, 0),
            (-115.6, 0),
            (-115.4, 1),
            (0.0, 8),
            (5.0, 8),
            (8.0, 9),
            (113.0, 15),
            (1e9, 15),
        ] {
            assert_eq!(NEAREST.index(v), want, "{v}");
        }
        assert_eq!(NEAREST.index(f32::NAN), 0);
        // Against a plain search, on a fine grid through every midpoint.
        for k in -2600..2600 {
            let v = k as f32 * 0.05;
            let plain = (0..16)
                .min_by(|&a, &b| {
                    let (da, db) = ((v - LEVELS_F32[a]).abs(), (v - LEVELS_F32[b]).abs());
                    da.partial_cmp(&db).unwrap().then(a.cmp(&b))
                })
                .unwrap();
            assert_eq!(NEAREST.index(v), plain, "{v}");
        }
    }

    #[test]
    fn round_trip_error_within_budget() {
        // 16 non-uniform levels: a little better than Q4_0 on bell-shaped values.
        let rel = relative_rms_error(GgmlType::IQ4_NL, &values(9, QK * 64, 1.0));
        assert!(rel < 0.09, "relative rmse {rel}");
        let flat = round_trip(GgmlType::IQ4_NL, &[0.0; QK]);
        assert!(flat.iter().all(|v| *v == 0.0));
    }
}
