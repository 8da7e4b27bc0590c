//! Q4_0: blocks of 32 4-bit values with an f16 scale, value = d · (q − 8). Dotted against Q8_0
//! activations.
//!
//! Summation order: exact i32 block sums of (q − 8) · a, then one accumulator updated with one
//! fused multiply-add per block in row order, `acc = fma(sum, d_w·d_a, acc)`; the AVX2 path
//! computes the block sums eight at a time and keeps that chain, so it matches the scalar bits.
//!
//! That is the order of llama.cpp's x86 CPU backend for Q4_0 on every path it takes (the
//! repacked `q4_0_8x8` gemm and gemv for 2-D weights, and MUL_MAT_ID over experts), so our rows
//! agree with its bit for bit when the activations do: a one-ulp difference can otherwise move
//! a later activation across a Q8 rounding boundary and grow into a visible logit difference.
//!
//! That chain is one FMA per block in series, so one row at a time is latency-bound far below
//! memory bandwidth. [`dot8`] therefore runs 8 rows at once: lane `r` of one vector accumulator
//! is row `r`'s chain, so each block is still exactly one FMA per row in block order (the same
//! bits as [`dot`]), while the integer work is shared where it can be (the activation block is
//! loaded once for all rows, `Σ (q − 8)·a` is computed as `Σ q·a − 8·Σ a` with the second term
//! prepared once per activation (`ActBuf`), and the 8 rows' block sums come out of one add tree).

use super::format::{Format, Kernel};
use super::q8_0::{ActQ8_0, BlockQ8_0, Q8Act};
use super::{f16_to_f32, f32_to_f16, max_by_magnitude, RawBlock};
use crate::gguf::GgmlType;
use std::ops::Range;

const QK: usize = 32;

/// One Q4_0 block as stored in GGUF: byte `j` holds value `j` (low nibble) and `j + 16` (high).
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ4_0 {
    d: [u8; 2],
    qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ4_0 {}

/// llama.cpp's reference quantizer: the value of largest magnitude maps to −8.
pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ4_0]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let d = max_by_magnitude(x) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = f32_to_f16(d);
        for j in 0..QK / 2 {
            // x·id lies in [-8, 8]; +8.5 then truncation rounds to the nearest level.
            let lo = ((x[j] * id + 8.5) as i32).clamp(0, 15) as u8;
            let hi = ((x[j + QK / 2] * id + 8.5) as i32).clamp(0, 15) as u8;
            b.qs[j] = lo | (hi << 4);
        }
    }
}

pub(super) fn dequantize(src: &[BlockQ4_0], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        for j in 0..QK / 2 {
            y[j] = ((b.qs[j] & 0x0F) as i32 - 8) as f32 * d;
            y[j + QK / 2] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// The Q4_0 weight format.
pub(crate) struct Q4_0;

impl Format for Q4_0 {
    const TY: GgmlType = GgmlType::Q4_0;
    type Block = BlockQ4_0;
    type Act = ActQ8_0;

    fn quantize(src: &[f32], dst: &mut [BlockQ4_0]) {
        quantize(src, dst)
    }

    fn dequantize(src: &[BlockQ4_0], dst: &mut [f32]) {
        dequantize(src, dst)
    }

    fn dot(w: &[BlockQ4_0], a: &Q8Act) -> f32 {
        dot_scalar(w, &a.blocks)
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel<Q4_0> for super::format::Avx2 {
    unsafe fn dot(w: &[BlockQ4_0], a: &Q8Act) -> f32 {
        // SAFETY: the caller's (AVX2, FMA and F16C are present).
        unsafe { dot_avx2(w, &a.blocks) }
    }

    /// Groups of 8 rows through [`dot8_avx2`] (the bits of [`Kernel::dot`] per row), the rest
    /// one at a time.
    unsafe fn dot_rows(w: &[u8], row_bytes: usize, rows: Range<usize>, a: &Q8Act, out: &mut [f32]) {
        let first = rows.start;
        let mut r = rows.start;
        while r + 8 <= rows.end && a.sums.len() >= a.blocks.len() {
            let band = &w[r * row_bytes..(r + 8) * row_bytes];
            // SAFETY: the caller's (AVX2, FMA and F16C are present); `band` holds the 8 rows.
            let v = unsafe { dot8_avx2(band, row_bytes, &a.blocks, &a.sums) };
            out[r - first..r - first + 8].copy_from_slice(&v);
            r += 8;
        }
        for r in r..rows.end {
            let row = super::blocks(&w[r * row_bytes..(r + 1) * row_bytes]);
            // SAFETY: as above.
            out[r - first] = unsafe { dot_avx2(row, &a.blocks) };
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon;

/// The chain one row at a time; four rows in the lanes of one vector for `dot_rows`; up to
/// four tokens in the lanes for `dot_group` (`q4_0/neon.rs`).
#[cfg(target_arch = "aarch64")]
macro_rules! q4_0_arm {
    ($level:ident, $dot:ident, $rows:ident, $group:ident $(, $wide:ident)?) => {
        impl Kernel<Q4_0> for super::format::$level {
            unsafe fn dot(w: &[BlockQ4_0], a: &Q8Act) -> f32 {
                // SAFETY: the caller's (the level is available).
                unsafe { neon::$dot(w, a) }
            }

            unsafe fn dot_rows(w: &[u8], row_bytes: usize, rows: Range<usize>, a: &Q8Act, out: &mut [f32]) {
                // SAFETY: the caller's.
                unsafe { neon::$rows(w, row_bytes, rows, a, out) }
            }

            const GROUPED: bool = true;

            unsafe fn dot_group<const N: usize>(w: &[BlockQ4_0], a: [&Q8Act; N]) -> [f32; N] {
                // SAFETY: the caller's.
                unsafe { neon::$group::<N>(w, a) }
            }

            $(
            const WIDE: bool = true;

            /// `smmla`'s 2 rows × 2 tokens beat the grouped dots from 2 tokens on.
            const WIDE_MIN: usize = 2;

            unsafe fn dot_wide(
                w: &[u8],
                row_bytes: usize,
                rows: Range<usize>,
                a: &[&super::ActBuf],
                out: &mut [&mut [f32]],
            ) {
                // SAFETY: the caller's (i8mm is present).
                unsafe { neon::$wide(w, row_bytes, rows, a, out) }
            }
            )?
        }
    };
}
#[cfg(target_arch = "aarch64")]
q4_0_arm!(Neon, dot_neon, rows_neon, group_neon);
#[cfg(target_arch = "aarch64")]
q4_0_arm!(Dotprod, dot_dotprod, rows_dotprod, group_dotprod);
#[cfg(target_arch = "aarch64")]
q4_0_arm!(I8mm, dot_dotprod, rows_dotprod, group_dotprod, wide_i8mm);

#[inline(always)]
fn block_sum(x: &BlockQ4_0, y: &BlockQ8_0) -> i32 {
    let mut s = 0i32;
    for j in 0..QK / 2 {
        s += ((x.qs[j] & 0x0F) as i32 - 8) * y.qs[j] as i32;
        s += ((x.qs[j] >> 4) as i32 - 8) * y.qs[j + QK / 2] as i32;
    }
    s
}

/// One block's step of the accumulator: its exact sum times `d_w·d_a`, fused into `acc`.
#[inline(always)]
fn accumulate(acc: f32, d_w: [u8; 2], d_a: [u8; 2], sum: i32) -> f32 {
    (sum as f32).mul_add(f16_to_f32(d_w) * f16_to_f32(d_a), acc)
}

pub(super) fn dot_scalar(w: &[BlockQ4_0], a: &[BlockQ8_0]) -> f32 {
    w.iter().zip(a).fold(0f32, |acc, (x, y)| {
        accumulate(acc, x.d, y.d, block_sum(x, y))
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(w: &[BlockQ4_0], a: &[BlockQ8_0]) -> f32 {
    use super::q8_0::x86;
    use std::arch::x86_64::*;
    let n = w.len().min(a.len());
    let full = n / 8 * 8;
    let m4 = _mm_set1_epi8(0x0F);
    let eight = _mm256_set1_epi8(8);
    let mut acc = _mm_setzero_ps();
    let mut b = 0;
    while b < full {
        let mut sums = [_mm256_setzero_si256(); 8];
        let mut dw = [0u16; 8];
        let mut da = [0u16; 8];
        for k in 0..8 {
            let (x, y) = (&w[b + k], &a[b + k]);
            // SAFETY: qs is 16 bytes (weights) / 32 bytes (activations); unaligned loads.
            let packed = unsafe { _mm_loadu_si128(x.qs.as_ptr().cast()) };
            let lo = _mm_and_si128(packed, m4);
            let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), m4);
            let q = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), eight);
            let yv = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
            sums[k] = unsafe { x86::mul_sum_i8(q, yv) };
            dw[k] = u16::from_le_bytes(x.d);
            da[k] = u16::from_le_bytes(y.d);
        }
        let s = unsafe { x86::hsum_8x8(&sums) };
        // SAFETY: 8 u16 = 16 bytes each.
        let d = unsafe {
            _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(dw.as_ptr().cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(da.as_ptr().cast())),
            )
        };
        // The chain itself stays sequential (that is the order being matched); the lane
        // shuffles are off its critical path.
        let (p, d) = (_mm256_cvtepi32_ps(s), d);
        for half in [
            (_mm256_castps256_ps128(p), _mm256_castps256_ps128(d)),
            (_mm256_extractf128_ps(p, 1), _mm256_extractf128_ps(d, 1)),
        ] {
            let (ph, dh) = half;
            acc = _mm_fmadd_ss(ph, dh, acc);
            acc = _mm_fmadd_ss(_mm_movehdup_ps(ph), _mm_movehdup_ps(dh), acc);
            acc = _mm_fmadd_ss(_mm_movehl_ps(ph, ph), _mm_movehl_ps(dh, dh), acc);
            acc = _mm_fmadd_ss(
                _mm_shuffle_ps(ph, ph, 0b11),
                _mm_shuffle_ps(dh, dh, 0b11),
                acc,
            );
        }
        b += 8;
    }
    let mut acc = _mm_cvtss_f32(acc);
    for b in full..n {
        acc = accumulate(acc, w[b].d, a[b].d, block_sum(&w[b], &a[b]));
    }
    acc
}

/// 8 rows at once (see the file header). The rows' blocks are paired in 256-bit vectors, row
/// `k` in the low half and row `k + 4` in the high half, which makes the add tree's lanes come
/// out in row order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot8_avx2(w: &[u8], row_bytes: usize, a: &[BlockQ8_0], a_sums: &[i32]) -> [f32; 8] {
    use std::arch::x86_64::*;
    const BLOCK_BYTES: usize = std::mem::size_of::<BlockQ4_0>();
    let n = (row_bytes / BLOCK_BYTES).min(a.len());
    debug_assert!(w.len() >= 8 * row_bytes);
    let base = w.as_ptr();
    let m4 = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for (b, (y, &y_sum)) in a.iter().zip(a_sums).enumerate().take(n) {
        // SAFETY (all loads below): the activation block has 32 bytes of qs; weight block `b`
        // of row `r` spans bytes r·row_bytes + b·18 .. + 18, inside `w` since b < n and r < 8.
        let (ylo, yhi) = unsafe {
            let yp = y.qs.as_ptr();
            (
                _mm256_broadcastsi128_si256(_mm_loadu_si128(yp.cast())),
                _mm256_broadcastsi128_si256(_mm_loadu_si128(yp.add(16).cast())),
            )
        };
        // 8 · Σ a over the block (|Σ a| ≤ 32 · 128: exact).
        let c = _mm256_set1_epi32(8 * y_sum);
        let off = b * BLOCK_BYTES;
        // Eight interleaved slow streams, two to a 4 KiB page, defeat the hardware
        // prefetcher; the next 8 rows (contiguous, 8·row_bytes = n·144 bytes when the rows are
        // whole blocks) are fetched into L2 evenly over this group's blocks instead. A hint:
        // it never faults, even past the end of `w`.
        for line in 0..3 {
            let p = base.wrapping_add(8 * row_bytes + b * 8 * BLOCK_BYTES + line * 64);
            _mm_prefetch::<_MM_HINT_T1>(p.cast());
        }
        let mut sums = [_mm256_setzero_si256(); 4];
        for (k, sum) in sums.iter_mut().enumerate() {
            let q = unsafe {
                let p0 = base.add(k * row_bytes + off);
                let p1 = base.add((k + 4) * row_bytes + off);
                _mm256_set_m128i(
                    _mm_loadu_si128(p1.add(2).cast()),
                    _mm_loadu_si128(p0.add(2).cast()),
                )
            };
            let lo = _mm256_and_si256(q, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            // Unsigned nibbles (0..=15) times signed activations: each pair ≤ 2·15·128 and
            // the two halves' sum ≤ 7680 in magnitude, so no saturation.
            *sum = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
        }
        // Two 16-bit pairwise adds (≤ 4 · 7680 < 2^15, exact), then pairs widened to i32:
        // lane r = Σ q·a of row r; minus 8·Σ a it is the exact block sum of (q − 8)·a.
        let t = _mm256_madd_epi16(
            _mm256_hadd_epi16(
                _mm256_hadd_epi16(sums[0], sums[1]),
                _mm256_hadd_epi16(sums[2], sums[3]),
            ),
            ones,
        );
        let s = _mm256_sub_epi32(t, c);
        // The rows' f16 scales, row r in lane r.
        // SAFETY: the first 2 bytes of block b of row r < 8, inside `w` as above.
        let dw = |r: usize| unsafe { base.add(r * row_bytes + off).cast::<i16>().read_unaligned() };
        let d = _mm_setr_epi16(dw(0), dw(1), dw(2), dw(3), dw(4), dw(5), dw(6), dw(7));
        let d_w = _mm256_cvtph_ps(d);
        let d_a = _mm256_cvtph_ps(_mm_set1_epi16(u16::from_le_bytes(y.d) as i16));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d_w, d_a), acc);
    }
    let mut out = [0f32; 8];
    // SAFETY: 8 f32 = 32 bytes.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    out
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{ActBuf, SimdLevel};
    use super::*;

    #[test]
    fn rows_match_scalar_bits() {
        super::super::block32::checks::check_rows_match_scalar::<Q4_0>();
    }

    /// Grouped dots on aarch64 (each weight block unpacked once for the group's tokens).
    #[test]
    fn group_matches_single_bits() {
        check_group_matches_single::<Q4_0>(cfg!(target_arch = "aarch64"));
    }

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Q4_0>(&[(1, 1), (2, 7), (3, 8), (4, 19), (5, 128)], 50);
    }

    /// A matrix of `nb`-block rows (row bytes `row_bytes`, whole blocks), as bytes.
    fn matrix(seed: u64, n_rows: usize, nb: usize) -> Vec<u8> {
        (0..n_rows)
            .flat_map(|r| {
                let x = values(seed + r as u64, nb * QK, 0.1 + r as f32 * 0.03);
                quantized_bytes(GgmlType::Q4_0, &x)
            })
            .collect()
    }

    /// The first `n` rows of `w` at `level`, through the table (the 8-row kernel where the
    /// level has one).
    fn rows_at(level: SimdLevel, w: &[u8], row_bytes: usize, n: usize, act: &ActBuf) -> Vec<f32> {
        let mut out = vec![f32::NAN; n];
        let f = table_of::<Q4_0>().at(level);
        // SAFETY: `level` comes from `SimdLevel::available`; `w` holds n whole rows.
        unsafe { (f.rows)(w, row_bytes, 0..n, act, &mut out) };
        out
    }

    #[test]
    fn dot8_matches_dot_bits_per_row() {
        for (seed, nb) in [(11u64, 1usize), (12, 3), (13, 8), (14, 19), (15, 128)] {
            let row_bytes = nb * 18;
            // Random bytes too: extreme nibbles and scales (inf/NaN f16 included).
            let mut m = matrix(seed, 8, nb);
            let raw = bytes(seed + 99, 8 * row_bytes);
            m.extend_from_slice(&raw);
            let act = prepared(GgmlType::Q4_0, &values(seed + 50, nb * QK, 1.0));
            for base in [0, 8] {
                // 11 rows: one group of 8 and three single rows.
                let n = if base == 0 { 11 } else { 8 };
                let w = &m[base * row_bytes..(base + n) * row_bytes];
                for level in SimdLevel::available() {
                    let got = rows_at(level, w, row_bytes, n, &act);
                    for (r, g) in got.iter().enumerate() {
                        let want = scalar_dot::<Q4_0>(&w[r * row_bytes..(r + 1) * row_bytes], &act);
                        // NaN payloads (from NaN scales in the random rows) are not pinned.
                        assert!(
                            g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                            "{level:?} seed={seed} nb={nb} base={base} row={r}: {g} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// The llama.cpp rows again, eight at a time (each case in two row slots).
    #[test]
    fn dot8_matches_llama_cpp_rows_bit_for_bit() {
        let cases = llama_rows(include_bytes!("testdata/llama_rows_q4_0.bin"));
        for (i, case) in cases.iter().enumerate() {
            let act = prepared(GgmlType::Q4_0, &case.act);
            let row_bytes = case.row.len();
            // This case's row in slots i and i + 4, the other cases' rows (same width) elsewhere.
            let mut m = Vec::new();
            for slot in 0..8 {
                let c = &cases[if slot % 4 == i % 4 {
                    i
                } else {
                    slot % cases.len()
                }];
                if c.row.len() == row_bytes {
                    m.extend_from_slice(&c.row);
                } else {
                    m.extend_from_slice(&case.row);
                }
            }
            for level in SimdLevel::available() {
                let got = rows_at(level, &m, row_bytes, 8, &act);
                for slot in [i % 4, i % 4 + 4] {
                    assert_eq!(
                        got[slot].to_bits(),
                        case.expected.to_bits(),
                        "case {i} slot {slot} {level:?}: {} vs llama.cpp {}",
                        got[slot],
                        case.expected
                    );
                }
            }
        }
    }

    /// `attn_output` rows and the results llama.cpp computed for them, from f32 activations
    /// (so the Q8_0 activation quantizer is covered too): our order must give its bits at every
    /// SIMD level. The previous order (8 lanes of block terms) misses all four.
    #[test]
    fn matches_llama_cpp_rows_bit_for_bit() {
        check_llama_rows(
            GgmlType::Q4_0,
            include_bytes!("testdata/llama_rows_q4_0.bin"),
            4,
        );
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Q4_0>(&[31, 32, 33]);
    }

    #[test]
    fn round_trip_error_within_one_step() {
        let x = values(9, 32 * 64, 1.0);
        let back = round_trip(GgmlType::Q4_0, &x);
        for (xb, yb) in x.chunks(QK).zip(back.chunks(QK)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            // Step = amax/8. Half a step for most values; the value opposite the extreme
            // clips from +8 to +7, a whole step. Plus the f16 scale's rounding.
            for (p, q) in xb.iter().zip(yb) {
                assert!((p - q).abs() <= amax / 8.0 * 1.001 + amax * 2f32.powi(-10));
            }
        }
        // Root-mean-square error is about step/√12 for uniform rounding.
        let rms = |v: &[f32]| (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        let diff: Vec<f32> = x.iter().zip(&back).map(|(p, q)| p - q).collect();
        assert!(
            rms(&diff) < 0.12 * rms(&x),
            "rmse {} rms {}",
            rms(&diff),
            rms(&x)
        );
    }
}
