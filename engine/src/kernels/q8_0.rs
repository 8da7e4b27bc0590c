//! Q8_0: blocks of 32 int8 with an f16 scale. A weight format (attention K/V in Q4_K_M files)
//! and the activation format for Q4_0 and Q8_0 weights.
//!
//! Summation order (shared by every path): each block's products are summed exactly in i32 in
//! 8 lanes of 4 consecutive values (lane `k` holds values `4k .. 4k + 4`); each lane keeps one
//! float accumulator updated with one fused multiply-add per block,
//! `lane_k = fma(d_w·d_a, sum_k, lane_k)`; the 8 lanes are folded by [`super::reduce8`]. The
//! AVX2 path is exactly those 8 lanes, so it matches the scalar bits.
//!
//! That is the order of llama.cpp's x86 CPU backend for Q8_0 weights on every path it takes
//! (`ggml_vec_dot_q8_0_q8_0`, the llamafile gemm, MUL_MAT_ID), and [`quantize_activations`] is
//! its x86 activation quantizer, so our rows agree with its bit for bit when the inputs do: a
//! one-ulp difference can otherwise move a later activation across a rounding boundary and grow
//! into a visible logit difference.

#[cfg(target_arch = "x86_64")]
use super::format::Kernel;
use super::format::{Activation, Format};
use super::{f16_to_f32, f32_to_f16, nearest_int, reduce8, ActBuf, ActFormat, RawBlock};
use crate::gguf::GgmlType;

#[cfg(target_arch = "aarch64")]
mod neon;

/// Values per block.
pub(super) const QK: usize = 32;

/// One Q8_0 block as stored in GGUF.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockQ8_0 {
    /// Scale, f16 little-endian.
    pub(super) d: [u8; 2],
    pub(super) qs: [i8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
// SAFETY: byte arrays only: alignment 1, no padding, any bits valid.
unsafe impl RawBlock for BlockQ8_0 {}

impl BlockQ8_0 {
    pub(super) const ZERO: BlockQ8_0 = BlockQ8_0 {
        d: [0; 2],
        qs: [0; QK],
    };
}

/// Activations as llama.cpp's x86 CPU backend quantizes them for the 32-value weight formats
/// (`quantize_row_q8_0` with AVX/AVX2, and its 4-row repack form): scale `d = absmax / 127`
/// stored as f16, values `x · (127 / absmax)` rounded to nearest, ties to even. This differs
/// from the reference [`quantize`] (which rounds `x · (1 / d)` half away from zero) on values
/// within an ulp of a half step, and exact half steps are common in real activations.
/// Returns each block's unrounded scale `absmax / 127` (Q8_1's sum term uses it).
pub(super) fn quantize_activations(src: &[f32], dst: &mut [BlockQ8_0], d_f32: &mut [f32]) {
    #[cfg(target_arch = "aarch64")]
    {
        // Every aarch64 core has NEON; the same bytes (the tests compare them).
        neon::quantize_activations(src, dst, d_f32);
    }
    #[cfg(not(target_arch = "aarch64"))]
    quantize_activations_scalar(src, dst, d_f32);
}

/// [`quantize_activations`] value by value: the reference the vectorised forms match.
pub(super) fn quantize_activations_scalar(src: &[f32], dst: &mut [BlockQ8_0], d_f32: &mut [f32]) {
    for ((x, b), d) in src.chunks_exact(QK).zip(dst.iter_mut()).zip(d_f32) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        for (q, v) in b.qs.iter_mut().zip(x) {
            // |v · id| ≤ 127 (up to rounding of `id`, which the round brings back to 127).
            *q = nearest_int(v * id).clamp(-127, 127) as i8;
        }
        *d = amax / 127.0;
        b.d = f32_to_f16(*d);
    }
}

/// A prepared Q8_0 activation: the blocks, and per block what some weight formats fold in
/// once per block instead of per value.
#[derive(Default, Clone, Debug)]
pub(crate) struct Q8Act {
    pub(super) blocks: Vec<BlockQ8_0>,
    /// Σ qs of each block (Q4_0's `Σ (q − 8)·a = Σ q·a − 8·Σ a`).
    pub(super) sums: Vec<i32>,
    /// f16(d · Σ qs) with the unrounded f32 scale `d`: the `s` of llama.cpp's Q8_1 blocks
    /// (its x86 Q8_1 quantizer makes the same quants and scale as its Q8_0 one), the
    /// activation's share of a Q4_1/Q5_1 block's minimum term.
    pub(super) s: Vec<[u8; 2]>,
    /// Each block's scale `d` widened to f32 (exactly), so a kernel loads four blocks' scales
    /// with one load instead of converting each block's f16 (the NEON kernels).
    pub(super) d: Vec<f32>,
    /// Scratch: the unrounded scales.
    d_f32: Vec<f32>,
}

/// Q8_0 blocks as an [`Activation`].
pub(crate) struct ActQ8_0;

impl Activation for ActQ8_0 {
    const FORMAT: ActFormat = ActFormat::Q8_0;
    const BLOCK: usize = QK;
    type View = Q8Act;

    fn prepare(x: &[f32], buf: &mut ActBuf) {
        let a = &mut buf.q8_0;
        let n = x.len() / QK;
        a.blocks.resize(n, BlockQ8_0::ZERO);
        a.d_f32.resize(n, 0.0);
        quantize_activations(x, &mut a.blocks, &mut a.d_f32);
        a.sums.clear();
        a.sums.extend(a.blocks.iter().map(block_sum));
        a.s.clear();
        a.s.extend(
            a.sums
                .iter()
                .zip(&a.d_f32)
                .map(|(&sum, &d)| f32_to_f16(d * sum as f32)),
        );
        a.d.clear();
        a.d.extend(a.blocks.iter().map(|b| f16_to_f32(b.d)));
    }

    fn view(buf: &ActBuf) -> &Q8Act {
        &buf.q8_0
    }
}

/// Σ qs of a block (exact in i32).
#[inline(always)]
fn block_sum(b: &BlockQ8_0) -> i32 {
    #[cfg(target_arch = "aarch64")]
    {
        neon::block_sum(b)
    }
    #[cfg(not(target_arch = "aarch64"))]
    b.qs.iter().map(|&v| v as i32).sum::<i32>()
}

/// llama.cpp's reference quantizer (`quantize_row_q8_0_ref`, what `llama-quantize` writes):
/// scale = absmax / 127, values rounded half away from zero. For weights.
pub(super) fn quantize(src: &[f32], dst: &mut [BlockQ8_0]) {
    for (x, b) in src.chunks_exact(QK).zip(dst.iter_mut()) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (q, v) in b.qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
        b.d = f32_to_f16(d);
    }
}

pub(super) fn dequantize(src: &[BlockQ8_0], dst: &mut [f32]) {
    for (b, y) in src.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        for (o, q) in y.iter_mut().zip(&b.qs) {
            *o = d * *q as f32;
        }
    }
}

/// One block's step of the 8 lane accumulators: the lanes' exact sums fused with the block's
/// `d_w·d_a`; shared by every path.
#[inline(always)]
fn accumulate(lanes: &mut [f32; 8], d_w: [u8; 2], d_a: [u8; 2], sums: &[i32; 8]) {
    let d = f16_to_f32(d_w) * f16_to_f32(d_a);
    for (l, s) in lanes.iter_mut().zip(sums) {
        *l = d.mul_add(*s as f32, *l);
    }
}

/// The Q8_0 weight format.
pub(crate) struct Q8_0;

impl Format for Q8_0 {
    const TY: GgmlType = GgmlType::Q8_0;
    type Block = BlockQ8_0;
    type Act = ActQ8_0;

    fn quantize(src: &[f32], dst: &mut [BlockQ8_0]) {
        quantize(src, dst)
    }

    fn dequantize(src: &[BlockQ8_0], dst: &mut [f32]) {
        dequantize(src, dst)
    }

    fn dot(w: &[BlockQ8_0], a: &Q8Act) -> f32 {
        dot_scalar(w, &a.blocks)
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel<Q8_0> for super::format::Avx2 {
    unsafe fn dot(w: &[BlockQ8_0], a: &Q8Act) -> f32 {
        // SAFETY: the caller's (AVX2, FMA and F16C are present).
        unsafe { dot_avx2(w, &a.blocks) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Kernel<Q8_0> for super::format::Avx512 {
    /// AVX2's (the lanes kernel pays off only over many tokens).
    unsafe fn dot(w: &[BlockQ8_0], a: &Q8Act) -> f32 {
        // SAFETY: the caller's (the AVX-512 level includes AVX2's features).
        unsafe { dot_avx2(w, &a.blocks) }
    }

    const WIDE: bool = true;

    /// From 6 tokens on the lanes kernel is the faster (prefill CPU time of `small` Q8_0, 7
    /// repetitions under load 7: 6 against 8 tokens 1.02 (0.99–1.27), 10 against 8 0.98).
    const WIDE_MIN: usize = 6;

    unsafe fn dot_wide(
        w: &[u8],
        row_bytes: usize,
        rows: std::ops::Range<usize>,
        a: &[&ActBuf],
        out: &mut [&mut [f32]],
    ) {
        // SAFETY: the caller's.
        unsafe { avx512::dot_wide(w, row_bytes, rows, a, out) }
    }
}

/// A block's exact products summed in 8 lanes of 4 consecutive values.
#[inline(always)]
fn lane_sums(x: &BlockQ8_0, y: &BlockQ8_0) -> [i32; 8] {
    std::array::from_fn(|k| {
        (4 * k..4 * k + 4)
            .map(|i| x.qs[i] as i32 * y.qs[i] as i32)
            .sum()
    })
}

pub(super) fn dot_scalar(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    let mut lanes = [0f32; 8];
    for (x, y) in w.iter().zip(a) {
        accumulate(&mut lanes, x.d, y.d, &lane_sums(x, y));
    }
    reduce8(&lanes)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_avx2(w: &[BlockQ8_0], a: &[BlockQ8_0]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm256_setzero_ps();
    for (x, y) in w.iter().zip(a) {
        // SAFETY: each qs is 32 bytes; unaligned loads.
        let xv = unsafe { _mm256_loadu_si256(x.qs.as_ptr().cast()) };
        let yv = unsafe { _mm256_loadu_si256(y.qs.as_ptr().cast()) };
        // Lane k: values 4k..4k+4 (maddubs pairs, then madd pairs, all within 128-bit halves).
        let s = unsafe { x86::mul_sum_i8(xv, yv) };
        // SAFETY: F16C is present.
        let d = unsafe { super::f16c_mul(x.d, y.d) };
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(s), acc);
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    reduce8(&lanes)
}

/// AVX2 building blocks shared by the 32-value block formats.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    /// Sums of products of signed bytes, 4 adjacent pairs per i32 lane. Exact as long as one
    /// operand is in -127..=127 (activations always are): `maddubs` then sees at most
    /// 2 · 128 · 127 < 2^15.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256i {
        let ax = _mm256_sign_epi8(x, x);
        let sy = _mm256_sign_epi8(y, x);
        let dot = _mm256_maddubs_epi16(ax, sy);
        _mm256_madd_epi16(dot, _mm256_set1_epi16(1))
    }

    /// The total of each of 8 vectors, as the 8 lanes of one vector (in order).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub unsafe fn hsum_8x8(v: &[__m256i; 8]) -> __m256i {
        let h01 = _mm256_hadd_epi32(v[0], v[1]);
        let h23 = _mm256_hadd_epi32(v[2], v[3]);
        let h45 = _mm256_hadd_epi32(v[4], v[5]);
        let h67 = _mm256_hadd_epi32(v[6], v[7]);
        let h0123 = _mm256_hadd_epi32(h01, h23);
        let h4567 = _mm256_hadd_epi32(h45, h67);
        let lo = _mm256_permute2x128_si256(h0123, h4567, 0x20);
        let hi = _mm256_permute2x128_si256(h0123, h4567, 0x31);
        _mm256_add_epi32(lo, hi)
    }
}

/// The AVX-512 level: up to 16 tokens, one per i32 lane. `vpdpbusd` multiplies unsigned by
/// signed bytes, so the activations go in as `a + 128` (their sign bit flipped) and each sum
/// starts from `−128 · Σ w` of its 4 weights, computed once per row: the lane's exact sum
/// `Σ w · a` either way.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::format::Activation;
    use super::super::q8_k::{by_row_steps, PackRing};
    use super::super::{blocks, f16_to_f32, ActBuf};
    use super::{ActQ8_0, BlockQ8_0, QK};
    use std::arch::x86_64::*;

    /// Activations per call: one per i32 lane.
    const WIDE: usize = super::super::q8_k::WIDE;

    /// Up to [`WIDE`] tokens' blocks with the tokens in lanes: `qs[8b + k][t]` is values
    /// `4k .. 4k + 4` of block `b` of token `t`, each byte `a + 128`; `d[b][t]` the block's
    /// scale. Lanes past the last token are zero. Kept per thread, and reused by a later call
    /// on the same tokens (a product's row bands are one call each).
    #[derive(Default)]
    struct Lanes {
        qs: Vec<[u32; WIDE]>,
        d: Vec<[f32; WIDE]>,
        /// What the lanes hold: the tokens' [`ActBuf::stamp`]s and the block count.
        key: (Vec<u64>, usize),
    }

    /// What a row's block needs besides its bytes: per lane `k`, `−128 · Σ w[4k .. 4k + 4]`
    /// (≥ −128 · 4 · 128), and the scale.
    #[derive(Copy, Clone, Default)]
    #[repr(C, align(64))]
    struct RowBlock {
        corr: [i32; 8],
        d: f32,
    }

    thread_local! {
        /// The last packings (the oldest replaced first, as for the Q8_K lanes) and the
        /// current rows' per-block terms.
        static LANES: std::cell::RefCell<(PackRing<Lanes>, Vec<RowBlock>)> =
            std::cell::RefCell::new((PackRing::default(), Vec::new()));
    }

    /// Rows `rows` against up to 16 activations, packed once per call and reused by every
    /// row, two rows at a time (each activation load serves both).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn dot_wide(
        w: &[u8],
        row_bytes: usize,
        rows: std::ops::Range<usize>,
        a: &[&ActBuf],
        out: &mut [&mut [f32]],
    ) {
        let nb = row_bytes / std::mem::size_of::<BlockQ8_0>();
        let views: Vec<&[BlockQ8_0]> = a.iter().map(|a| &ActQ8_0::view(a).blocks[..]).collect();
        let nb = views.iter().fold(nb, |n, v| n.min(v.len()));
        LANES.with(|cell| {
            let (ring, terms) = &mut *cell.borrow_mut();
            let lanes = ring.get(
                |l: &Lanes| {
                    l.key.1 == nb
                        && l.key.0.len() == a.len()
                        && l.key.0.iter().zip(a).all(|(s, a)| *s == a.stamp())
                },
                |l| {
                    l.key.0.clear();
                    l.key.0.extend(a.iter().map(|a| a.stamp()));
                    l.key.1 = nb;
                    pack(l, &views, nb);
                },
            );
            terms.resize(2 * nb, RowBlock::default());
            let row = |r: usize| -> &[BlockQ8_0] {
                &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb]
            };
            by_row_steps::<2>(w, row_bytes, rows, out, |r, n| {
                let mut v = [[0f32; 16]; 2];
                // SAFETY: the caller's (this level's features are present).
                unsafe {
                    row_terms(row(r), &mut terms[..nb]);
                    if n == 2 {
                        row_terms(row(r + 1), &mut terms[nb..2 * nb]);
                        v = row_lanes::<2>([row(r), row(r + 1)], lanes, terms);
                    } else {
                        [v[0]] = row_lanes::<1>([row(r)], lanes, terms);
                    }
                }
                v
            });
        });
    }

    /// Packs the first `nb` blocks of each of `acts` (at most [`WIDE`]) into `lanes`.
    fn pack(lanes: &mut Lanes, acts: &[&[BlockQ8_0]], nb: usize) {
        lanes.qs.clear();
        lanes.qs.resize(8 * nb, [0; WIDE]);
        lanes.d.clear();
        lanes.d.resize(nb, [0.0; WIDE]);
        for (t, act) in acts.iter().enumerate().take(WIDE) {
            for (b, y) in act[..nb].iter().enumerate() {
                for (k, q) in y.qs.chunks_exact(4).enumerate() {
                    let v = u32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]);
                    lanes.qs[8 * b + k][t] = v ^ 0x8080_8080;
                }
                lanes.d[b][t] = f16_to_f32(y.d);
            }
        }
    }

    /// Each block's [`RowBlock`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline(never)]
    unsafe fn row_terms(w: &[BlockQ8_0], terms: &mut [RowBlock]) {
        let ones = _mm256_set1_epi8(1);
        let m128 = _mm256_set1_epi16(-128);
        for (x, t) in w.iter().zip(terms.iter_mut()) {
            // SAFETY: 32 bytes; 8 i32 stored into `corr`; F16C is present.
            unsafe {
                let q = _mm256_loadu_si256(x.qs.as_ptr().cast());
                // Pair sums ≥ −256, then lane k = −128 · Σ of its 4 (exact).
                let c = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, q), m128);
                _mm256_storeu_si256(t.corr.as_mut_ptr().cast(), c);
                t.d = super::super::f16c(x.d);
            }
        }
    }

    /// `R` rows against the packed tokens: per block and lane `k`, one `vpdpbusd` (the 4
    /// weight bytes broadcast × each token's 4 shifted activation bytes, from the row's
    /// correction) gives each token's exact lane sum, which takes the scalar fused
    /// multiply-add into that token's accumulator `k`; the 8 accumulators are folded as
    /// [`super::reduce8`]: the bits of [`super::dot_scalar`].
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    // `k`, the scalar order's lane, indexes the packed tokens, the scales and every row's
    // accumulators alike; an iterator over one of them would hide that.
    #[allow(clippy::needless_range_loop)]
    unsafe fn row_lanes<const R: usize>(
        w: [&[BlockQ8_0]; R],
        l: &Lanes,
        terms: &[RowBlock],
    ) -> [[f32; 16]; R] {
        const { assert!(QK == 32) };
        let nb = w[0].len();
        let mut acc = [[_mm512_setzero_ps(); 8]; R];
        for b in 0..nb {
            let t: [&RowBlock; R] = std::array::from_fn(|r| &terms[r * nb + b]);
            // SAFETY: 16 floats.
            let d_a = unsafe { _mm512_loadu_ps(l.d[b].as_ptr()) };
            let d: [__m512; R] =
                std::array::from_fn(|r| _mm512_mul_ps(_mm512_set1_ps(t[r].d), d_a));
            for k in 0..8 {
                // SAFETY: 64 bytes of one packed row; 4 bytes inside each block's qs.
                let y = unsafe { _mm512_loadu_si512(l.qs[8 * b + k].as_ptr().cast()) };
                for r in 0..R {
                    let wq = unsafe {
                        std::ptr::read_unaligned(w[r][b].qs.as_ptr().add(4 * k).cast::<i32>())
                    };
                    // ≤ 4 · 255 · 128 in magnitude per step: exact.
                    let s = _mm512_dpbusd_epi32(
                        _mm512_set1_epi32(t[r].corr[k]),
                        y,
                        _mm512_set1_epi32(wq),
                    );
                    acc[r][k] = _mm512_fmadd_ps(d[r], _mm512_cvtepi32_ps(s), acc[r][k]);
                }
            }
        }
        std::array::from_fn(|r| {
            let a = &acc[r];
            // reduce8: halves, then quarters, then pairs.
            let h: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(a[i], a[i + 4]));
            let v = _mm512_add_ps(_mm512_add_ps(h[0], h[2]), _mm512_add_ps(h[1], h[3]));
            let mut o = [0f32; 16];
            // SAFETY: 16 floats.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
            o
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    /// The lanes kernel (AVX-512) gives each of 1 to 16 tokens the single dot's bits, for
    /// every row step it takes; so does the grouped one (aarch64 dotprod).
    #[test]
    fn wide_dot_matches_single_dots_bits() {
        check_group_matches_single::<Q8_0>(cfg!(target_arch = "aarch64"));
    }

    /// ns per (block, token) at each level and width (`--ignored --nocapture`).
    #[test]
    #[ignore]
    fn group_speed() {
        print_group_speed::<Q8_0>();
    }

    #[test]
    fn simd_matches_scalar_bits() {
        check_simd_matches_scalar::<Q8_0>(&[(1, 1), (2, 7), (3, 8), (4, 19), (5, 128)], 50);
    }

    /// `attn_output` rows and the results llama.cpp computed for them from f32 activations: our
    /// activation quantizer and order must give its bits at every SIMD level. The previous
    /// order (8 lanes of block terms) misses all four.
    #[test]
    fn matches_llama_cpp_rows_bit_for_bit() {
        check_llama_rows(
            GgmlType::Q8_0,
            include_bytes!("testdata/llama_rows_q8_0.bin"),
            4,
        );
    }

    /// Exact half steps (absmax 127 makes the multiplier exactly 1) round to even in the
    /// activation quantizer, as llama.cpp's x86 `quantize_row_q8_0` does, and away from zero
    /// in the weight quantizer, as its `quantize_row_q8_0_ref` does.
    #[test]
    fn activation_halves_round_to_even() {
        let mut x = [0f32; QK];
        x[..6].copy_from_slice(&[127.0, 2.5, -2.5, 3.5, 0.5, -126.5]);
        let mut act = [BlockQ8_0::ZERO];
        quantize_activations(&x, &mut act, &mut [0.0]);
        assert_eq!(act[0].qs[..6], [127, 2, -2, 4, 0, -126]);
        assert_eq!(f16_to_f32(act[0].d), 1.0);
        let mut w = [BlockQ8_0::ZERO];
        quantize(&x, &mut w);
        assert_eq!(w[0].qs[..6], [127, 3, -3, 4, 1, -127]);
    }

    /// The activation multiplier is `127 / absmax`, not `1 / (absmax / 127)`: find an absmax
    /// where the two floats differ and a value they round to different levels, and check which
    /// one the quantizer took.
    #[test]
    fn activation_multiplier_is_127_over_absmax() {
        let mut found = false;
        for k in 0..100_000u32 {
            let amax = 1.0f32 + k as f32 * f32::EPSILON;
            let (id_x86, id_ref) = (127.0 / amax, 1.0 / (amax / 127.0));
            if id_x86 == id_ref {
                continue;
            }
            // A value just below a half step under one multiplier and on it under the other.
            for level in 1..127 {
                let v = (level as f32 + 0.5) / id_x86;
                for v in [
                    v,
                    f32::from_bits(v.to_bits() + 1),
                    f32::from_bits(v.to_bits() - 1),
                ] {
                    let (a, b) = (
                        (v * id_x86).round_ties_even(),
                        (v * id_ref).round_ties_even(),
                    );
                    if a == b || v.abs() > amax {
                        continue;
                    }
                    let mut x = [0f32; QK];
                    x[0] = amax;
                    x[1] = v;
                    let mut act = [BlockQ8_0::ZERO];
                    quantize_activations(&x, &mut act, &mut [0.0]);
                    assert_eq!(act[0].qs[1] as f32, a, "amax {amax} v {v}");
                    found = true;
                }
            }
            if found {
                return;
            }
        }
        panic!("no distinguishing case found");
    }

    #[test]
    fn scalar_matches_dequantized_and_f32_reference() {
        check_scalar_against_references::<Q8_0>(&[21, 22, 23]);
    }

    #[test]
    fn round_trip_error_within_half_a_step() {
        let x = values(9, 32 * 64, 1.0);
        let back = round_trip(GgmlType::Q8_0, &x);
        for (xb, yb) in x.chunks(QK).zip(back.chunks(QK)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (p, q) in xb.iter().zip(yb) {
                assert!((p - q).abs() <= amax * (1.0 / 254.0 + 2f32.powi(-11)) * 1.001);
            }
        }
        // All-zero blocks stay zero (no division by zero).
        let z = q8_0_blocks(&[0.0; 32]);
        assert_eq!(z[0], BlockQ8_0::ZERO);
    }
}
