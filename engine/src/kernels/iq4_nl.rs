//! IQ4_NL: blocks of 32 4-bit indices into a fixed non-linear table of 16 levels, with an f16
//! scale: value = d · K[q]. `llama-quantize` writes it as a preset and for rows the 256-value
//! IQ formats cannot hold. Dotted against Q8_0 activations, order [`Order::Pairs`] (llama.cpp's
//! x86 `ggml_vec_dot_iq4_nl_q8_0`).
//!
//! Layout (18 bytes): `d` (f16), `qs[16]`: byte `j` holds index `j` (low nibble) and index
//! `j + 16` (high nibble).

use super::block32::{
    self, block32_format, nearest_index, nibble, pack_nibbles, Block32, Order, QK,
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

    fn levels(&self) -> [i8; QK] {
        std::array::from_fn(|i| LEVELS[nibble(&self.qs, i) as usize])
    }

    fn scale(&self) -> f32 {
        f16_to_f32(self.d)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn levels_avx2(&self) -> std::arch::x86_64::__m256i {
        // SAFETY: the caller's (AVX2 is present).
        unsafe { block32::x86::lookup(&LEVELS, block32::x86::nibbles(&self.qs)) }
    }
}

/// The table as floats, for the quantizers' nearest-level search.
fn levels_f32() -> [f32; 16] {
    LEVELS.map(|v| v as f32)
}

/// Fits one group of values to `scale · LEVELS[index]` (IQ4_NL blocks, IQ4_XS sub-blocks):
/// tries the scales that put the value of largest magnitude on either end of the table and a
/// few around them, refits each by least squares on its chosen indices, and keeps the one with
/// the smallest squared error. Returns (scale, indices).
pub(super) fn fit_group(x: &[f32]) -> (f32, Vec<u8>) {
    let table = levels_f32();
    let max = max_by_magnitude(x);
    if max == 0.0 {
        // Index 8 is the level nearest zero (1); any scale of 0 makes every value 0.
        return (0.0, vec![8; x.len()]);
    }
    let indices = |scale: f32| -> Vec<u8> {
        let inv = 1.0 / scale;
        x.iter()
            .map(|v| nearest_index(&table, v * inv) as u8)
            .collect()
    };
    let error = |scale: f32, idx: &[u8]| -> f32 {
        x.iter()
            .zip(idx)
            .map(|(v, &i)| (v - scale * table[i as usize]).powi(2))
            .sum()
    };
    let mut best = (f32::INFINITY, 0.0, Vec::new());
    for end in [table[0], table[15]] {
        for step in -3i32..=3 {
            let scale = max / end * (1.0 + step as f32 / 24.0);
            let idx = indices(scale);
            // Least-squares scale for these indices.
            let (num, den) = x.iter().zip(&idx).fold((0f32, 0f32), |(n, d), (v, &i)| {
                (n + v * table[i as usize], d + table[i as usize].powi(2))
            });
            let refit = if den > 0.0 { num / den } else { scale };
            for s in [scale, refit] {
                if s == 0.0 || !s.is_finite() {
                    continue;
                }
                let idx = indices(s);
                let e = error(s, &idx);
                if e < best.0 {
                    best = (e, s, idx);
                }
            }
        }
    }
    (best.1, best.2)
}

pub(super) fn quantize(src: &[f32], dst: &mut [BlockIq4Nl]) {
    let table = levels_f32();
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let (scale, _) = fit_group(x);
        let d = f32_to_f16(scale);
        let d_f = f16_to_f32(d);
        // Indices against the stored scale, so dequantization sees what was chosen.
        let idx: [u8; QK] = if d_f != 0.0 {
            std::array::from_fn(|i| nearest_index(&table, x[i] / d_f) as u8)
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
        let t = levels_f32();
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
            assert_eq!(nearest_index(&t, v), want, "{v}");
        }
        assert_eq!(nearest_index(&t, f32::NAN), 0);
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
