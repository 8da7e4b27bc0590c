//! Q6_K on aarch64: the one-token and grouped dots at the NEON and dotprod levels, the
//! `smmla` prefill kernel at i8mm, and the token packing the K-quants' `smmla` kernels share
//! ([`MmTokens`], also used by Q2_K and Q3_K).
//!
//! Why this shape: the scalar order keeps 8 lane sums per super-block, lane `k` holding values
//! `4k .. 4k + 4` of each group of 32; a 16-value `sdot` gives exactly four of them (values
//! 16j .. 16j + 16 are lanes 0–3 of a group for even j, lanes 4–7 for odd j), so a group's
//! two runs go into the two halves of the 8 lanes. Each half's runs accumulate in one running
//! `sdot` sum (no zeroing per run), and one `mla` by element per run applies the difference of
//! consecutive run scales to it ([`half_sums`]: the telescoped form of Σ sc · sum, exact in
//! i32). Without dotprod the same four lane sums come from `smull` + pairwise adds (pair sums
//! ≤ 2 · 63 · 127 fit an i16) accumulated by `sadalp`. The offset `32 · (sc_2k·bsum_2k +
//! sc_2k+1·bsum_2k+1)` comes from the block sums, then the scalar's fused multiply-add per lane
//! and the [`reduce8`] tree: the bits of [`super::dot_scalar`].
//!
//! `smmla` multiplies 2 × 8 bytes by 2 × 8 bytes, so its 8-deep sums must stay inside one lane
//! and share one scale; a lane has only 4 values per run, so the run scale goes into the
//! weights instead: `w = sc · q` (|w| ≤ 8064) split into two byte planes `w = 256 · hi + lo`
//! (hi −32..=31 signed, lo 0..=255 unsigned: the i16 product's two bytes, split by one `uzp`
//! each), each a plain 8-bit dot. Each row pair is unpacked once per call into those planes
//! with the 8 bytes of an `smmla` row being lane `k` of two groups of 32 ([`Q6Pair`]), and
//! the tokens are packed the same way once per call ([`MmTokens`]); then per lane, row pair
//! and token pair the offset (`smull`, `smull2`, `add`), 4 `usmmla` on the low plane onto it
//! and beside them 4 `smmla` on the high plane, added times 256 by one `mla`: the 2 × 2
//! exact lane sums, each taking its (row, token)'s fused multiply-add.

use super::super::format::{Activation, Dotprod, I8mm, Kernel, Neon};
use super::super::neon::{f16_to_f32, reduce8, sdot, smmla, usmmla, zeros_by_load};
use super::super::q4_k::neon::mla_lane as mla_lane_const;
use super::super::q8_k::{by_row_steps, ActQ8K, BlockQ8K, PackRing, WIDE};
use super::super::{blocks, ActBuf};
use super::{BlockQ6K, Q6K};
use std::arch::aarch64::*;
use std::arch::asm;
use std::ops::Range;

/// A 16-value product added into four lane sums (`acc[l] + Σ_{i<4} q[4l + i] · a[4l + i]`),
/// exactly, for weights whose pair products fit an i16 (|q| ≤ 63).
pub(in crate::kernels) trait Dot16 {
    /// # Safety
    /// The CPU has the implementing level.
    unsafe fn dot16(acc: int32x4_t, q: int8x16_t, a: int8x16_t) -> int32x4_t;
}

/// Every aarch64 core: widening multiplies and pairwise adds.
pub(in crate::kernels) struct ByMull;
impl Dot16 for ByMull {
    #[inline(always)]
    unsafe fn dot16(acc: int32x4_t, q: int8x16_t, a: int8x16_t) -> int32x4_t {
        // SAFETY (every intrinsic): base Advanced SIMD, register-only.
        unsafe {
            let lo = vmull_s8(vget_low_s8(q), vget_low_s8(a));
            let hi = vmull_high_s8(q, a);
            // Pair sums ≤ 2 · 63 · 127: exact in i16; then pairs of pairs widened and added.
            vpadalq_s16(acc, vpaddq_s16(lo, hi))
        }
    }
}

/// FEAT_DotProd: one `sdot`.
pub(in crate::kernels) struct BySdot;
impl Dot16 for BySdot {
    #[inline(always)]
    unsafe fn dot16(acc: int32x4_t, q: int8x16_t, a: int8x16_t) -> int32x4_t {
        // SAFETY: the caller's (dotprod is present).
        unsafe { sdot(acc, q, a) }
    }
}

/// `acc + p · s[lane]` (`mla` by element; `lane` < 4 is a constant after inlining).
#[inline(always)]
unsafe fn mla_lane(acc: int32x4_t, p: int32x4_t, s: int32x4_t, lane: usize) -> int32x4_t {
    // SAFETY (every arm): base Advanced SIMD, register-only.
    unsafe {
        match lane & 3 {
            0 => vmlaq_laneq_s32::<0>(acc, p, s),
            1 => vmlaq_laneq_s32::<1>(acc, p, s),
            2 => vmlaq_laneq_s32::<2>(acc, p, s),
            _ => vmlaq_laneq_s32::<3>(acc, p, s),
        }
    }
}

/// `v` unchanged, hidden from the optimizer: without it LLVM sees that the multipliers are
/// widened bytes and replaces each `mla` by element with a `dup` and a widening of its own
/// (twice the instructions).
#[inline(always)]
fn opaque(mut v: int32x4_t) -> int32x4_t {
    // SAFETY: an empty instruction sequence (a comment naming the register).
    unsafe {
        std::arch::asm!("// {v:v}", v = inout(vreg) v, options(pure, nomem, nostack, preserves_flags))
    };
    v
}

/// The 16 run scales (`sc16[0]`: runs 0–7, `[1]`: 8–15, as i16) as the multipliers of
/// [`half_sums`]' running sums, as i32 vectors of four runs each: run `r`'s is
/// `sc_r − sc_{r+2}`, except for the last two runs, `sc_r`.
#[inline(always)]
unsafe fn run_multipliers(sc16: [int16x8_t; 2]) -> [int32x4_t; 4] {
    // SAFETY (every intrinsic): base Advanced SIMD, register-only.
    unsafe {
        let m = [
            vsubq_s16(sc16[0], vextq_s16::<2>(sc16[0], sc16[1])),
            vsubq_s16(sc16[1], vextq_s16::<2>(sc16[1], vdupq_n_s16(0))),
        ];
        [
            vmovl_s16(vget_low_s16(m[0])),
            vmovl_high_s16(m[0]),
            vmovl_s16(vget_low_s16(m[1])),
            vmovl_high_s16(m[1]),
        ]
        .map(opaque)
    }
}

/// [`run_multipliers`] of scales of magnitude at most 63 (their differences fit a byte): the
/// differences taken on bytes, then widened.
#[inline(always)]
pub(in crate::kernels) unsafe fn run_multipliers_i8(sc: int8x16_t) -> [int32x4_t; 4] {
    // SAFETY (every intrinsic): base Advanced SIMD, register-only.
    unsafe {
        let m = vsubq_s8(sc, vextq_s8::<2>(sc, vdupq_n_s8(0)));
        let m16 = [vmovl_s8(vget_low_s8(m)), vmovl_high_s8(m)];
        [
            vmovl_s16(vget_low_s16(m16[0])),
            vmovl_high_s16(m16[0]),
            vmovl_s16(vget_low_s16(m16[1])),
            vmovl_high_s16(m16[1]),
        ]
        .map(opaque)
    }
}

/// Adds half `h` of a super-block (its levels `v`, vector `j` = values `128h + 16j ..` = run
/// `8h + j`) against each of `y` into the exact lane sums `acc` (lanes 0–3, 4–7): even `j`
/// are lanes 0–3 of a group of 32, odd `j` lanes 4–7. The runs of one lane half `c`
/// (`c + 2i`, i < 8, over both halves) are summed in a running total `p[c]` (no zeroing
/// between runs; zero before half 0), and with `mult` from [`run_multipliers`] `Σ_i sc_i ·
/// p_i = Σ_{i<7} (sc_i − sc_{i+1}) · P_i + sc_7 · P_7`: one `mla` per run all the same. Exact:
/// i32 arithmetic wraps modulo 2^32 and the result, the lane sum, fits.
#[inline(always)]
pub(in crate::kernels) unsafe fn half_sums<D: Dot16, const N: usize>(
    v: &[int8x16_t; 8],
    y: [&BlockQ8K; N],
    h: usize,
    mult: &[int32x4_t; 4],
    p: &mut [[int32x4_t; 2]; N],
    acc: &mut [[int32x4_t; 2]; N],
) {
    // SAFETY: 64-byte loads inside y.qs (256) at 128h + 64c < 256 (h < 2); the rest is
    // register-only; the caller's level.
    unsafe {
        for (t, (acc, p)) in acc.iter_mut().zip(p.iter_mut()).enumerate() {
            let a0 = vld1q_s8_x4(y[t].qs.as_ptr().add(128 * h));
            let a1 = vld1q_s8_x4(y[t].qs.as_ptr().add(128 * h + 64));
            let a = [a0.0, a0.1, a0.2, a0.3, a1.0, a1.1, a1.2, a1.3];
            for j in 0..8 {
                let c = j % 2;
                p[c] = D::dot16(p[c], v[j], a[j]);
                acc[c] = mla_lane(acc[c], p[c], mult[2 * h + j / 4], j % 4);
            }
        }
    }
}

/// The levels (0..=63) of half `h` (< 2) of `x`: vector `j` holds values `128h + 16j ..
/// 128h + 16j + 16` (run `8h + j`). The low nibbles keep their place under the high bits
/// shifted in by `sli`; the high nibbles shift down into the masked high bits by `sri`.
#[inline(always)]
unsafe fn levels(x: &BlockQ6K, h: usize) -> [int8x16_t; 8] {
    // SAFETY: 64 bytes inside ql (128) and 32 inside qh (64), as h < 2; the rest is
    // register-only base Advanced SIMD.
    unsafe {
        let q = vld1q_u8_x4(x.ql.as_ptr().add(64 * h));
        let hb = vld1q_u8_x2(x.qh.as_ptr().add(32 * h));
        let (m3, m30) = (vdupq_n_u8(3), vdupq_n_u8(0x30));
        let (h0s, h1s) = (vshrq_n_u8::<2>(hb.0), vshrq_n_u8::<2>(hb.1));
        [
            vsliq_n_u8::<4>(q.0, vandq_u8(hb.0, m3)),
            vsliq_n_u8::<4>(q.1, vandq_u8(hb.1, m3)),
            vsliq_n_u8::<4>(q.2, vandq_u8(h0s, m3)),
            vsliq_n_u8::<4>(q.3, vandq_u8(h1s, m3)),
            vsriq_n_u8::<4>(vandq_u8(hb.0, m30), q.0),
            vsriq_n_u8::<4>(vandq_u8(hb.1, m30), q.1),
            vsriq_n_u8::<4>(vandq_u8(h0s, m30), q.2),
            vsriq_n_u8::<4>(vandq_u8(h1s, m30), q.3),
        ]
        .map(|v| vreinterpretq_s8_u8(v))
    }
}

/// The exact lane sums (lanes 0–3, 4–7) of one super-block against `N` activation blocks,
/// the weights decoded once for all.
#[inline(always)]
unsafe fn block_sums<D: Dot16, const N: usize>(
    x: &BlockQ6K,
    y: [&BlockQ8K; N],
) -> [[int32x4_t; 2]; N] {
    // SAFETY (every block): 16-byte scale and 32-byte bsums loads; the rest is register-only;
    // the caller's level.
    unsafe {
        let sc8 = vld1q_s8(x.scales.as_ptr());
        let sc16 = [vmovl_s8(vget_low_s8(sc8)), vmovl_high_s8(sc8)];
        let mult = run_multipliers(sc16);
        let mut acc = [[vdupq_n_s32(0); 2]; N];
        let mut p = acc;
        for h in 0..2 {
            half_sums::<D, N>(&levels(x, h), y, h, &mult, &mut p, &mut acc);
        }
        for (t, acc) in acc.iter_mut().enumerate() {
            let bs = vld1q_s16_x2(y[t].bsums.as_ptr());
            // Lane k: sc_2k·bsum_2k + sc_2k+1·bsum_2k+1 (lanes 0–3 from runs 0–7, 4–7 from 8–15).
            let off = [
                vpaddq_s32(
                    vmull_s16(vget_low_s16(sc16[0]), vget_low_s16(bs.0)),
                    vmull_high_s16(sc16[0], bs.0),
                ),
                vpaddq_s32(
                    vmull_s16(vget_low_s16(sc16[1]), vget_low_s16(bs.1)),
                    vmull_high_s16(sc16[1], bs.1),
                ),
            ];
            for i in 0..2 {
                acc[i] = vsubq_s32(acc[i], vshlq_n_s32::<5>(off[i]));
            }
        }
        acc
    }
}

/// `N` dots of one row (the scalar order for each), each block decoded once.
#[inline(always)]
unsafe fn dot_n<D: Dot16, const N: usize>(w: &[BlockQ6K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
    // Every row cut to n blocks: no bounds checks in the loop.
    let a = a.map(|a| &a[..n]);
    // SAFETY (every intrinsic): register-only base Advanced SIMD; the caller's level.
    unsafe {
        let mut lanes = [[vdupq_n_f32(0.0); 2]; N];
        for (i, x) in w[..n].iter().enumerate() {
            let y: [&BlockQ8K; N] = std::array::from_fn(|t| &a[t][i]);
            let s = block_sums::<D, N>(x, y);
            let xd = f16_to_f32(x.d);
            for t in 0..N {
                let d = y[t].d * xd;
                for k in 0..2 {
                    lanes[t][k] = vfmaq_n_f32(lanes[t][k], vcvtq_f32_s32(s[t][k]), d);
                }
            }
        }
        lanes.map(|l| reduce8(l[0], l[1]))
    }
}

#[target_feature(enable = "dotprod")]
unsafe fn dot_n_dotprod<const N: usize>(w: &[BlockQ6K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    // SAFETY: dotprod is present (this function's feature).
    unsafe { dot_n::<BySdot, N>(w, a) }
}

impl Kernel<Q6K> for Neon {
    unsafe fn dot(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: base Advanced SIMD only.
        let [v] = unsafe { dot_n::<ByMull, 1>(w, [a]) };
        v
    }

    /// The 6-bit decoding is a fifth of the work here: shared by a group's tokens.
    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ6K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: base Advanced SIMD only.
        unsafe { dot_n::<ByMull, N>(w, a) }
    }
}

impl Kernel<Q6K> for Dotprod {
    unsafe fn dot(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (dotprod is present).
        let [v] = unsafe { dot_n_dotprod::<1>(w, [a]) };
        v
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ6K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n_dotprod::<N>(w, a) }
    }
}

impl Kernel<Q6K> for I8mm {
    unsafe fn dot(w: &[BlockQ6K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (i8mm includes dotprod).
        let [v] = unsafe { dot_n_dotprod::<1>(w, [a]) };
        v
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ6K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n_dotprod::<N>(w, a) }
    }

    const WIDE: bool = true;

    /// llvm-mca (Neoverse N2 / V1), cycles per row, token and super-block of a 2-row
    /// product, this lanes kernel against the dotprod groups of 4 (and the 2 or 3, or the
    /// lone token, left over): 4 tokens 36.8 / 19.0 against 34.9 / 17.2; 5 tokens 36.8 /
    /// 19.8 against 38.0 / 18.8; 6 tokens 30.7 / 16.5 against 35.8 / 17.7; 8 tokens 26.4 /
    /// 14.2 against 34.9 / 17.2; 16 tokens 20.4 / 11.1. (It was 10, when the row pair's
    /// unpacking and the token pairs cost about twice as much.)
    const WIDE_MIN: usize = 6;

    unsafe fn dot_wide(
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
        a: &[&ActBuf],
        out: &mut [&mut [f32]],
    ) {
        // SAFETY: the caller's.
        unsafe { dot_wide(w, row_bytes, rows, a, out) }
    }
}

/// Up to [`WIDE`] tokens' Q8_K blocks laid out for `smmla` by the K-quants' 8 lanes, tokens in
/// pairs (`2tp`, `2tp + 1`; a missing last token is zeros):
/// - `qs[((8b + k) · pairs + tp) · 4 + p]`: 16 bytes, per token of the pair (first 8 bytes the
///   even one) values `64p + 4k .. + 4` and `64p + 32 + 4k .. + 4` of block `b`: lane `k` of
///   groups `2p` and `2p + 1`, an `smmla` operand row each;
/// - `bs[(8b + k) · pairs + tp]`: the block sums as i16 `[t0, t1, t0, t1]` of run `2k`, then
///   of run `2k + 1` (the layout of the 2 × 2 `smmla` result, rows × tokens);
/// - `d[b · pairs + tp]`: the scales `[t0, t1, t0, t1]`.
///
/// Kept per thread ([`PackRing`], keyed by the tokens' stamps) like the x86 lanes.
#[derive(Default)]
pub(in crate::kernels) struct MmTokens {
    pub qs: Vec<[i8; 16]>,
    pub bs: Vec<[i16; 8]>,
    pub d: Vec<[f32; 4]>,
    /// Token pairs.
    pub pairs: usize,
    /// What it holds: the tokens' stamps and the block count.
    key: (Vec<u64>, usize),
}

impl MmTokens {
    fn holds(&self, acts: &[&ActBuf], nb: usize) -> bool {
        self.key.1 == nb
            && self.key.0.len() == acts.len()
            && self.key.0.iter().zip(acts).all(|(s, a)| *s == a.stamp())
    }

    /// Packs the first `nb` blocks of each of `acts` (at most [`WIDE`], each at least `nb`
    /// blocks long).
    fn pack(&mut self, acts: &[&ActBuf], nb: usize) {
        self.key.0.clear();
        self.key.0.extend(acts.iter().map(|a| a.stamp()));
        self.key.1 = nb;
        let pairs = acts.len().min(WIDE).div_ceil(2);
        self.pairs = pairs;
        self.qs.clear();
        self.qs.resize(nb * 8 * pairs * 4, [0; 16]);
        self.bs.clear();
        self.bs.resize(nb * 8 * pairs, [0; 8]);
        self.d.clear();
        self.d.resize(nb * pairs, [0.0; 4]);
        for (t, act) in acts.iter().enumerate().take(WIDE) {
            let (tp, side) = (t / 2, t % 2);
            for (b, y) in ActQ8K::view(act)[..nb].iter().enumerate() {
                for k in 0..8 {
                    for p in 0..4 {
                        let o = &mut self.qs[((8 * b + k) * pairs + tp) * 4 + p];
                        for i in 0..4 {
                            o[8 * side + i] = y.qs[64 * p + 4 * k + i];
                            o[8 * side + 4 + i] = y.qs[64 * p + 32 + 4 * k + i];
                        }
                    }
                    let s = &mut self.bs[(8 * b + k) * pairs + tp];
                    (s[side], s[2 + side]) = (y.bsums[2 * k], y.bsums[2 * k]);
                    (s[4 + side], s[6 + side]) = (y.bsums[2 * k + 1], y.bsums[2 * k + 1]);
                }
                let d = &mut self.d[b * pairs + tp];
                (d[side], d[2 + side]) = (y.d, y.d);
            }
        }
    }
}

/// The packed tokens of one call: a slot of `ring` that holds them, else one repacked.
pub(in crate::kernels) fn mm_tokens<'a>(
    ring: &'a mut PackRing<MmTokens>,
    acts: &[&ActBuf],
    nb: usize,
) -> &'a MmTokens {
    ring.get(|l| l.holds(acts, nb), |l| l.pack(acts, nb))
}

/// The lanes of the 2 × 2 results `[r0·t0, r0·t1, r1·t0, r1·t1]` folded as [`reduce8`]
/// (halves, then quarters, then pairs), each (row, token) on its own.
#[inline(always)]
pub(in crate::kernels) unsafe fn fold_tile(f: &[float32x4_t; 8]) -> [f32; 4] {
    // SAFETY (every intrinsic): register-only base Advanced SIMD; a 4-float store.
    unsafe {
        let h: [float32x4_t; 4] = std::array::from_fn(|i| vaddq_f32(f[i], f[i + 4]));
        let v = vaddq_f32(vaddq_f32(h[0], h[2]), vaddq_f32(h[1], h[3]));
        let mut o = [0f32; 4];
        vst1q_f32(o.as_mut_ptr(), v);
        o
    }
}

/// Two rows' 16 per-run i16 values (`v[r][0]`: runs 0–7, `[1]`: 8–15) as the operands of
/// the `smlal` / `smlal2` pair of lane `k` (index `k`): `[r0, r0, r1, r1]` of run `2k`, then
/// of run `2k + 1` (the 2 × 2 result layout, rows × tokens).
#[inline(always)]
pub(in crate::kernels) unsafe fn pair_runs(v: [[int16x8_t; 2]; 2]) -> [int16x8_t; 8] {
    // SAFETY (every intrinsic): register-only base Advanced SIMD.
    unsafe {
        let mut out = [vdupq_n_s16(0); 8];
        for half in 0..2 {
            // Each run's value twice: runs 8·half + 4q .. + 4 in vector q.
            let dup = |x: int16x8_t| [vzip1q_s16(x, x), vzip2q_s16(x, x)];
            let (a, b) = (dup(v[0][half]), dup(v[1][half]));
            for q in 0..2 {
                let (a, b) = (vreinterpretq_s32_s16(a[q]), vreinterpretq_s32_s16(b[q]));
                out[4 * half + 2 * q] = vreinterpretq_s16_s32(vzip1q_s32(a, b));
                out[4 * half + 2 * q + 1] = vreinterpretq_s16_s32(vzip2q_s32(a, b));
            }
        }
        out
    }
}

/// `1.5 · 2^23` as f32 bits: an integer `x` with `|x| < 2^22` added to it is the float
/// `1.5 · 2^23 + x` exactly, so subtracting the float gives `x as f32` (both exact) in two
/// cheap instructions (`scvtf` takes a pipe for two cycles on Neoverse N2). Q2_K's and
/// Q3_K's lane sums stay far inside that range (≤ 32 · 128 · 127).
pub(in crate::kernels) const MAGIC: i32 = 0x4b40_0000;

/// `v − MAGIC` as f32, for `v` holding `MAGIC + x`, `|x| < 2^22`: exactly `x as f32`.
#[inline(always)]
pub(in crate::kernels) unsafe fn from_magic(v: int32x4_t) -> float32x4_t {
    // SAFETY: register-only base Advanced SIMD.
    unsafe { vsubq_f32(vreinterpretq_f32_s32(v), vdupq_n_f32(12_582_912.0)) }
}

/// Byte rows `[r0 (8 bytes), r1 (8 bytes)]` per lane `k` (index `k`) from two rows' planes of
/// one pair of groups: `g[r]` = the row's vectors of groups `2p` (lanes 0–3, 4–7) and `2p + 1`
/// (lanes 0–3, 4–7), 4 bytes per lane.
#[inline(always)]
pub(in crate::kernels) unsafe fn lane_rows(g: [[int8x16_t; 4]; 2]) -> [int8x16_t; 8] {
    // SAFETY (every intrinsic): register-only base Advanced SIMD.
    unsafe {
        // Per row, lanes (k, k + 1) of both groups: [g0.k, g1.k, g0.k+1, g1.k+1].
        let per_row = g.map(|g| {
            let (a0, b0) = (vreinterpretq_s32_s8(g[0]), vreinterpretq_s32_s8(g[1]));
            let (a1, b1) = (vreinterpretq_s32_s8(g[2]), vreinterpretq_s32_s8(g[3]));
            [
                vreinterpretq_s64_s32(vzip1q_s32(a0, a1)),
                vreinterpretq_s64_s32(vzip2q_s32(a0, a1)),
                vreinterpretq_s64_s32(vzip1q_s32(b0, b1)),
                vreinterpretq_s64_s32(vzip2q_s32(b0, b1)),
            ]
        });
        std::array::from_fn(|k| {
            let (r0, r1) = (per_row[0][k / 2], per_row[1][k / 2]);
            vreinterpretq_s8_s64(if k % 2 == 0 {
                vzip1q_s64(r0, r1)
            } else {
                vzip2q_s64(r0, r1)
            })
        })
    }
}

/// A row pair's super-blocks unpacked once per call for [`pair_tokens`]:
/// - `w[((8b + k) · 4 + p) · 2 + plane]`: of `w = sc · q = 256 · hi + lo` (`hi` −32..=31,
///   `lo` 0..=255), plane 0 the bytes `hi` (signed), plane 1 the bytes `lo` (unsigned, for
///   `usmmla`), as [`lane_rows`] lays them out: 16 bytes per (lane `k`, group pair `p`), row
///   0's 8 then row 1's, each lane `k` of group `2p` then of group `2p + 1`;
/// - `sc[8b + k]`: `−32 · sc` as i16 `[r0, r0, r1, r1]` of run `2k`, then of run `2k + 1`;
/// - `d[b]`: the rows' scales `[r0, r0, r1, r1]`.
#[derive(Default)]
struct Q6Pair {
    w: Vec<[i8; 16]>,
    sc: Vec<[i16; 8]>,
    d: Vec<[f32; 4]>,
}

/// `tbl` indices into a block's 16 scales: for group pair `p` and lane half `s` (lanes
/// `4s .. 4s + 4`), the scale of run `A = 4p + s` (lane half `s` of group `2p`) in bytes 0–3
/// and 8–11, of run `C = 4p + 2 + s` (of group `2p + 1`) in bytes 4–7 and 12–15: the layout
/// of `zip1`/`zip2` of the two runs' levels by 32-bit lanes.
const SCALE_IDX: [[u8; 16]; 8] = {
    let mut m = [[0u8; 16]; 8];
    let mut i = 0;
    while i < 8 {
        let (p, s) = (i / 2, i % 2);
        let mut j = 0;
        while j < 16 {
            m[i][j] = (4 * p + s + if j % 8 < 4 { 0 } else { 2 }) as u8;
            j += 1;
        }
        i += 1;
    }
    m
};

/// The 8 i16 products of the low (`HIGH` false: `smull`) or high (`smull2`) 8 bytes of `a`
/// and `b`, as 16 bytes. Inline assembly: LLVM, seeing levels that cannot be negative,
/// rewrote some `smull` into two widenings and a 16-bit `mul` (three vector instructions).
#[inline(always)]
fn smull8<const HIGH: bool>(a: int8x16_t, b: int8x16_t) -> int8x16_t {
    let out: int8x16_t;
    // SAFETY (both arms): register-only base Advanced SIMD instructions.
    unsafe {
        if HIGH {
            asm!(
                "smull2 {o:v}.8h, {a:v}.16b, {b:v}.16b",
                o = lateout(vreg) out,
                a = in(vreg) a,
                b = in(vreg) b,
                options(pure, nomem, nostack, preserves_flags)
            )
        } else {
            asm!(
                "smull {o:v}.8h, {a:v}.8b, {b:v}.8b",
                o = lateout(vreg) out,
                a = in(vreg) a,
                b = in(vreg) b,
                options(pure, nomem, nostack, preserves_flags)
            )
        }
    };
    out
}

/// Unpacks rows `x[0]`, `x[1]` (`nb` blocks each) into `u`. Per half super-block and row
/// the 8 run vectors of levels ([`levels`]); the two runs of a lane half in a group pair
/// (`4p + s`, `4p + 2 + s`) interleaved by 32-bit lanes (`zip1`/`zip2`: 8-byte chunks that
/// are one lane `k` of groups `2p` and `2p + 1`, the order of an `smmla` operand row); each
/// chunk times its scales (`smull`/`smull2` by a `tbl` of the block's scales) as i16, and
/// the two rows' chunks of a lane split into planes by `uzp2` (high bytes) and `uzp1` (low
/// bytes): the two operands, rows side by side, in four instructions per 8 values of each
/// row. (The earlier unpacking, per run `smull`, narrowing shifts, a mask, then the
/// operands' permutations, took twice the vector instructions: llvm-mca, Neoverse N2.)
#[inline(never)]
fn unpack_pair(x: [&[BlockQ6K]; 2], u: &mut Q6Pair) {
    let nb = x[0].len().min(x[1].len());
    u.w.resize(nb * 64, [0; 16]);
    u.sc.resize(nb * 8, [0; 8]);
    u.d.resize(nb, [0.0; 4]);
    for b in 0..nb {
        let xb = [&x[0][b], &x[1][b]];
        let wb = &mut u.w[64 * b..64 * b + 64];
        // SAFETY (every intrinsic): base Advanced SIMD; 16-byte loads of the scales and of
        // `SCALE_IDX` rows; 16-byte stores into `wb` (64 entries, indices below 64).
        unsafe {
            let sc = xb.map(|x| vld1q_s8(x.scales.as_ptr()));
            for h in 0..2 {
                // Runs 8h .. 8h + 8 (group pairs 2h, 2h + 1) of both rows.
                let v = xb.map(|x| levels(x, h).map(|v| vreinterpretq_s32_s8(v)));
                for ph in 0..2 {
                    let p = 2 * h + ph;
                    for s in 0..2 {
                        let (a, c) = (4 * ph + s, 4 * ph + 2 + s);
                        let z = [0, 1].map(|r| {
                            [vzip1q_s32(v[r][a], v[r][c]), vzip2q_s32(v[r][a], v[r][c])]
                                .map(|v| vreinterpretq_s8_s32(v))
                        });
                        let idx = vld1q_u8(SCALE_IDX[2 * p + s].as_ptr());
                        let scv = sc.map(|sc| vqtbl1q_s8(sc, idx));
                        for l in 0..4 {
                            // Lane 4s + l of both rows: |sc · q| ≤ 128 · 63, exact in i16.
                            let w = [0, 1].map(|r| {
                                let zz = z[r][l / 2];
                                if l % 2 == 0 {
                                    smull8::<false>(zz, scv[r])
                                } else {
                                    smull8::<true>(zz, scv[r])
                                }
                            });
                            let k = 4 * s + l;
                            vst1q_s8(wb[(4 * k + p) * 2].as_mut_ptr(), vuzp2q_s8(w[0], w[1]));
                            vst1q_s8(wb[(4 * k + p) * 2 + 1].as_mut_ptr(), vuzp1q_s8(w[0], w[1]));
                        }
                    }
                }
            }
        }
        // −32 · sc per run as i16 (|−32 · −128| = 4096).
        // SAFETY (every intrinsic): base Advanced SIMD; a 16-byte load of scales; 16-byte
        // stores into `u.sc` at 8b + k < its length.
        unsafe {
            let v = xb.map(|x| {
                let s = vld1q_s8(x.scales.as_ptr());
                [vmovl_s8(vget_low_s8(s)), vmovl_high_s8(s)].map(|h| vshlq_n_s16::<5>(vnegq_s16(h)))
            });
            for (k, v) in pair_runs(v).into_iter().enumerate() {
                vst1q_s16(u.sc[8 * b + k].as_mut_ptr(), v);
            }
        }
        let d = xb.map(|x| f16_to_f32(x.d));
        u.d[b] = [d[0], d[0], d[1], d[1]];
    }
}

/// Token pairs `tp0 .. tp0 + TPN` of `l` against the unpacked row pair `u` (`nb` blocks):
/// per pair the 8 lane accumulators of the 2 × 2 (rows × tokens) results, folded. A lane at
/// a time over all the blocks, so that its `TPN` accumulators stay in registers (block-major,
/// the 8 · `TPN` of them went to the stack and back each block: load slots, which Neoverse
/// V1 ran short of); `dd[b · TPN + i]` is pair `tp0 + i`'s `d_token · d_row` of block `b`
/// (computed once per pass instead of once per lane). Each lane still takes its blocks in
/// order: the same fused multiply-adds.
#[target_feature(enable = "dotprod,i8mm")]
#[inline]
unsafe fn pair_tokens<const TPN: usize>(
    u: &Q6Pair,
    l: &MmTokens,
    tp0: usize,
    nb: usize,
    dd: &[[f32; 4]],
) -> [[f32; 4]; TPN] {
    let pairs = l.pairs;
    assert!(tp0 + TPN <= pairs && u.w.len() >= nb * 64 && l.qs.len() >= nb * 32 * pairs);
    assert!(u.sc.len() >= nb * 8 && l.bs.len() >= nb * 8 * pairs && dd.len() >= nb * TPN);
    // SAFETY: every index below is inside its vector by the lengths above (`w`: 64 per block,
    // `sc`: 8; `qs`: 32 · pairs per block, `bs`: 8 · pairs; `dd`: TPN); i8mm and dotprod are
    // present (this function's features).
    unsafe {
        // 256 in lane 0, the multiplier of the high plane's sums.
        let k256 = vsetq_lane_s32::<0>(256, vdupq_n_s32(0));
        let mut f = [[vdupq_n_f32(0.0); 8]; TPN];
        for k in 0..8 {
            let mut fk = [vdupq_n_f32(0.0); TPN];
            for b in 0..nb {
                let wp = u.w.as_ptr().add((8 * b + k) * 8).cast::<i8>();
                let sc = vld1q_s16(u.sc.get_unchecked(8 * b + k).as_ptr());
                for (i, fk) in fk.iter_mut().enumerate() {
                    let at = (8 * b + k) * pairs + tp0 + i;
                    let bp = l.qs.as_ptr().add(4 * at).cast::<i8>();
                    let bs = vld1q_s16(l.bs.get_unchecked(at).as_ptr());
                    // −32 · Σ sc·bsum (a fresh accumulator: the two runs' products side by
                    // side and added, where `smlal2` after `smull` made a longer chain and
                    // took the pipe the `mla` and `scvtf` need on Neoverse N2) + Σ lo·a
                    // (`usmmla`: `lo` is unsigned), and beside it Σ hi·a (from zeros loaded,
                    // not a vector `movi`), added times 256 by one `mla`: the exact lane sum.
                    let mut acc = vaddq_s32(
                        vmull_s16(vget_low_s16(sc), vget_low_s16(bs)),
                        opaque(vmull_high_s16(sc, bs)),
                    );
                    let mut hi = zeros_by_load();
                    for p in 0..4 {
                        let a = vld1q_s8(bp.add(16 * p));
                        hi = smmla(hi, vld1q_s8(wp.add(32 * p)), a);
                        acc = usmmla(acc, vld1q_u8(wp.add(32 * p + 16).cast::<u8>()), a);
                    }
                    acc = mla_lane_const::<0>(acc, hi, k256);
                    let d = vld1q_f32(dd.get_unchecked(b * TPN + i).as_ptr());
                    *fk = vfmaq_f32(*fk, vcvtq_f32_s32(acc), d);
                }
            }
            for (f, fk) in f.iter_mut().zip(fk) {
                f[k] = fk;
            }
        }
        f.map(|f| fold_tile(&f))
    }
}

/// `dd[b · TPN + i] = d_token · d_row` of block `b` for token pairs `tp0 + i` (`i < TPN`):
/// the scalar's `y.d · f16(x.d)` per lane of the 2 × 2 layout.
fn pair_scales<const TPN: usize>(
    u: &Q6Pair,
    l: &MmTokens,
    tp0: usize,
    nb: usize,
    dd: &mut Vec<[f32; 4]>,
) {
    dd.clear();
    dd.resize(nb * TPN, [0.0; 4]);
    for b in 0..nb {
        // SAFETY: base Advanced SIMD; 4-float loads and stores of array entries.
        unsafe {
            let dx = vld1q_f32(u.d[b].as_ptr());
            for i in 0..TPN {
                let dt = vld1q_f32(l.d[b * l.pairs + tp0 + i].as_ptr());
                vst1q_f32(dd[b * TPN + i].as_mut_ptr(), vmulq_f32(dt, dx));
            }
        }
    }
}

thread_local! {
    /// The packed tokens and the unpacked row pair of the current call.
    static MM: std::cell::RefCell<(PackRing<MmTokens>, Q6Pair, Vec<[f32; 4]>)> =
        std::cell::RefCell::new((PackRing::default(), Q6Pair::default(), Vec::new()));
}

/// Rows `rows` against up to 16 activations: two rows a step (the second repeated for a last
/// odd row), the tokens two pairs at a time.
#[target_feature(enable = "dotprod,i8mm")]
unsafe fn dot_wide(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &[&ActBuf],
    out: &mut [&mut [f32]],
) {
    let nb = row_bytes / std::mem::size_of::<BlockQ6K>();
    let nb = a.iter().fold(nb, |n, a| n.min(ActQ8K::view(a).len()));
    MM.with(|cell| {
        let (ring, u, dd) = &mut *cell.borrow_mut();
        let l = mm_tokens(ring, a, nb);
        let row =
            |r: usize| -> &[BlockQ6K] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
        by_row_steps::<2>(w, row_bytes, rows, out, |r, n| {
            unpack_pair([row(r), row(r + n - 1)], u);
            let mut v = [[0f32; WIDE]; 2];
            let mut tp = 0;
            while tp < l.pairs {
                let put = |v: &mut [[f32; WIDE]; 2], tp: usize, o: [f32; 4]| {
                    (v[0][2 * tp], v[0][2 * tp + 1]) = (o[0], o[1]);
                    (v[1][2 * tp], v[1][2 * tp + 1]) = (o[2], o[3]);
                };
                // SAFETY: the caller's (i8mm is present); tp + 2 or + 1 ≤ pairs.
                if l.pairs - tp >= 2 {
                    pair_scales::<2>(u, l, tp, nb, dd);
                    let o = unsafe { pair_tokens::<2>(u, l, tp, nb, dd) };
                    put(&mut v, tp, o[0]);
                    put(&mut v, tp + 1, o[1]);
                    tp += 2;
                } else {
                    pair_scales::<1>(u, l, tp, nb, dd);
                    let [o] = unsafe { pair_tokens::<1>(u, l, tp, nb, dd) };
                    put(&mut v, tp, o);
                    tp += 1;
                }
            }
            v
        });
    });
}
