//! aarch64 kernels of Q4_0: the scalar's one fused chain per row (`acc = fma(sum, d_w·d_a,
//! acc)` block after block), with the exact block sums from `sdot` (or, without FEAT_DotProd,
//! `smull` + `addp` + `sadalp`).
//!
//! Why this shape: the chain is one dependent fused multiply-add per block, so one row alone
//! is bound by its latency. [`rows`] therefore puts 4 rows in the 4 lanes of one accumulator
//! (each lane still takes exactly one fused step per block, in block order: the bits of
//! [`dot`]); [`group`] puts up to 4 tokens in the lanes; with i8mm, [`wide`] takes 2 rows × 2
//! tokens per `smmla` (8-value dots: Q4_0 sums each block whole, so any split of the 32
//! products is exact). Block sums are `Σ q·a − 8·Σ a` (the second term prepared once per
//! activation, [`Q8Act::sums`]) where the weights are not shared, and `Σ (q − 8)·a` where they
//! are (grouped, wide).
//!
//! The integer sums run on over the blocks without being zeroed (wrapping; a block's sum is
//! the difference of two running sums, exact in i32), which saves a zeroing per accumulator
//! and block.

use super::super::block32::neon::{f16x4, LaneDot, Sdot, Widen};
use super::super::format::{prefetch_lines, PREFETCH_AHEAD};
use super::super::neon as arm;
use super::super::q8_0::Q8Act;
use super::super::{blocks, ActBuf};
use super::{BlockQ4_0, QK};
use std::arch::aarch64::*;
use std::ops::Range;

/// The 32 nibbles of a block: values 0–15 and 16–31, unsigned.
#[inline(always)]
fn nibbles(x: &BlockQ4_0) -> [int8x16_t; 2] {
    // SAFETY: 16 bytes; base Advanced SIMD.
    unsafe {
        let v = vld1q_u8(x.qs.as_ptr());
        [
            vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))),
            vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)),
        ]
    }
}

/// The levels `q − 8` of a block (signed).
#[inline(always)]
fn levels(x: &BlockQ4_0) -> [int8x16_t; 2] {
    let q = nibbles(x);
    // SAFETY: base Advanced SIMD, register-only.
    unsafe { q.map(|v| vsubq_s8(v, vdupq_n_s8(8))) }
}

/// The 32 activation bytes of block `i`.
#[inline(always)]
fn act(a: &Q8Act, i: usize) -> [int8x16_t; 2] {
    let p = a.blocks[i].qs.as_ptr();
    // SAFETY: 32 bytes of qs; base Advanced SIMD.
    unsafe { [vld1q_s8(p), vld1q_s8(p.add(16))] }
}

/// `acc + Σ q·y` over the block's 32 values, in 4 lanes (running sum, wrapping).
#[inline(always)]
unsafe fn block_dot<D: LaneDot>(acc: int32x4_t, q: [int8x16_t; 2], y: [int8x16_t; 2]) -> int32x4_t {
    // SAFETY: the caller's (the level of `D`).
    unsafe { D::dot(D::dot(acc, q[0], y[0]), q[1], y[1]) }
}

/// Lane `k` = the sum of the 4 lanes of `v[k]` (the rows' or tokens' running sums side by side).
#[inline(always)]
fn lane_totals(v: [int32x4_t; 4]) -> int32x4_t {
    // SAFETY: base Advanced SIMD, register-only.
    unsafe { vpaddq_s32(vpaddq_s32(v[0], v[1]), vpaddq_s32(v[2], v[3])) }
}

/// One row's exact block sum `Σ (q − 8)·a` (the tails).
#[inline(always)]
unsafe fn block_sum<D: LaneDot>(x: &BlockQ4_0, a: &Q8Act, i: usize) -> i32 {
    // SAFETY: the caller's.
    unsafe { vaddvq_s32(block_dot::<D>(vdupq_n_s32(0), levels(x), act(a, i))) }
}

/// One block's step of the scalar chain.
#[inline(always)]
fn step(acc: f32, sum: i32, d_w: [u8; 2], d_a: [u8; 2]) -> f32 {
    (sum as f32).mul_add(arm::f16_to_f32(d_w) * arm::f16_to_f32(d_a), acc)
}

/// [`super::dot_scalar`]: four blocks a step, their sums side by side in one vector, then the
/// four fused steps of the chain in order.
#[inline(always)]
unsafe fn dot_core<D: LaneDot>(w: &[BlockQ4_0], a: &Q8Act) -> f32 {
    let n = w.len().min(a.blocks.len());
    let full = if a.sums.len() >= n { n / 4 * 4 } else { 0 };
    let mut acc = 0f32;
    // SAFETY (the whole body): the caller's (the level of `D`); block indices are below `n`.
    unsafe {
        let mut run = [vdupq_n_s32(0); 4];
        let mut prev = vdupq_n_s32(0);
        let mut b = 0;
        while b < full {
            for (k, r) in run.iter_mut().enumerate() {
                *r = block_dot::<D>(*r, nibbles(&w[b + k]), act(a, b + k));
            }
            let t = lane_totals(run);
            let sums = vld1q_s32(a.sums[b..].as_ptr());
            let s = vsubq_s32(vsubq_s32(t, prev), vshlq_n_s32::<3>(sums));
            prev = t;
            let f = vcvtq_f32_s32(s);
            let d = vmulq_f32(
                f16x4(std::array::from_fn(|k| w[b + k].d)),
                f16x4(std::array::from_fn(|k| a.blocks[b + k].d)),
            );
            acc = vfmas_laneq_f32::<0>(acc, vgetq_lane_f32::<0>(f), d);
            acc = vfmas_laneq_f32::<1>(acc, vgetq_lane_f32::<1>(f), d);
            acc = vfmas_laneq_f32::<2>(acc, vgetq_lane_f32::<2>(f), d);
            acc = vfmas_laneq_f32::<3>(acc, vgetq_lane_f32::<3>(f), d);
            b += 4;
        }
        for i in b..n {
            acc = step(acc, block_sum::<D>(&w[i], a, i), w[i].d, a.blocks[i].d);
        }
    }
    acc
}

/// Four rows (row `r` in lane `r`; the same bits as [`dot_core`] on each).
#[inline(always)]
unsafe fn rows4_core<D: LaneDot>(w: [&[BlockQ4_0]; 4], a: &Q8Act) -> [f32; 4] {
    let n = w
        .iter()
        .fold(a.blocks.len().min(a.sums.len()), |n, r| n.min(r.len()));
    let mut out = [0f32; 4];
    // SAFETY (the whole body): the caller's (the level of `D`); block indices are below `n`.
    unsafe {
        let mut run = [vdupq_n_s32(0); 4];
        let mut prev = vdupq_n_s32(0);
        let mut acc = vdupq_n_f32(0.0);
        let eight = vdupq_n_s32(8);
        let mut b = 0;
        macro_rules! step {
            ($i:expr, $k:literal, $sums:expr, $da:expr) => {{
                let i = $i;
                let y = act(a, i);
                for (r, run) in run.iter_mut().enumerate() {
                    *run = block_dot::<D>(*run, nibbles(&w[r][i]), y);
                }
                let t = lane_totals(run);
                let s = vmlsq_laneq_s32::<$k>(vsubq_s32(t, prev), eight, $sums);
                prev = t;
                let dw = f16x4(std::array::from_fn(|r| w[r][i].d));
                acc = vfmaq_f32(acc, vcvtq_f32_s32(s), vmulq_laneq_f32::<$k>(dw, $da));
            }};
        }
        while b + 4 <= n {
            let sums = vld1q_s32(a.sums[b..].as_ptr());
            let da = f16x4(std::array::from_fn(|k| a.blocks[b + k].d));
            step!(b, 0, sums, da);
            step!(b + 1, 1, sums, da);
            step!(b + 2, 2, sums, da);
            step!(b + 3, 3, sums, da);
            b += 4;
        }
        while b < n {
            let sums = vdupq_n_s32(a.sums[b]);
            let da = vdupq_n_f32(arm::f16_to_f32(a.blocks[b].d));
            step!(b, 0, sums, da);
            b += 1;
        }
        vst1q_f32(out.as_mut_ptr(), acc);
    }
    out
}

/// Rows `rows` (as [`super::super::format::Kernel::dot_rows`]): four at a time, the rest one by one.
#[inline(always)]
unsafe fn rows_core<D: LaneDot>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    let row = |r: usize| -> &[BlockQ4_0] { blocks(&w[r * row_bytes..(r + 1) * row_bytes]) };
    let first = rows.start;
    let mut r = rows.start;
    while r + 4 <= rows.end && a.sums.len() >= a.blocks.len() {
        prefetch_lines(w, r * row_bytes + PREFETCH_AHEAD, 4 * row_bytes);
        // SAFETY: the caller's (the level of `D`).
        let v = unsafe { rows4_core::<D>([row(r), row(r + 1), row(r + 2), row(r + 3)], a) };
        out[r - first..r - first + 4].copy_from_slice(&v);
        r += 4;
    }
    for r in r..rows.end {
        prefetch_lines(w, r * row_bytes + PREFETCH_AHEAD, row_bytes);
        // SAFETY: as above.
        out[r - first] = unsafe { dot_core::<D>(row(r), a) };
    }
}

/// One row against `N ≤ 4` tokens, token `t` in lane `t`.
#[inline(always)]
unsafe fn group_core<D: LaneDot, const N: usize>(w: &[BlockQ4_0], a: [&Q8Act; N]) -> [f32; N] {
    let n = a.iter().fold(w.len(), |n, a| n.min(a.blocks.len()));
    let mut out = [0f32; 4];
    // SAFETY (the whole body): the caller's (the level of `D`); block indices are below `n`.
    unsafe {
        let mut run = [vdupq_n_s32(0); 4];
        let mut prev = vdupq_n_s32(0);
        let mut acc = vdupq_n_f32(0.0);
        for (i, x) in w[..n].iter().enumerate() {
            let q = levels(x);
            for t in 0..N {
                run[t] = block_dot::<D>(run[t], q, act(a[t], i));
            }
            let tot = lane_totals(run);
            let s = vsubq_s32(tot, prev);
            prev = tot;
            let da = f16x4(std::array::from_fn(|t| {
                if t < N {
                    a[t].blocks[i].d
                } else {
                    [0; 2]
                }
            }));
            let d = vmulq_n_f32(da, arm::f16_to_f32(x.d));
            acc = vfmaq_f32(acc, vcvtq_f32_s32(s), d);
        }
        vst1q_f32(out.as_mut_ptr(), acc);
    }
    std::array::from_fn(|t| out[t])
}

/// [`super::dot_scalar`] with base Advanced SIMD.
///
/// # Safety
/// None beyond aarch64.
pub(super) unsafe fn dot_neon(w: &[BlockQ4_0], a: &Q8Act) -> f32 {
    // SAFETY: base Advanced SIMD.
    unsafe { dot_core::<Widen>(w, a) }
}

/// [`rows_core`] with base Advanced SIMD.
///
/// # Safety
/// `rows` lie inside `w`; `out.len() == rows.len()`.
pub(super) unsafe fn rows_neon(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    // SAFETY: the caller's.
    unsafe { rows_core::<Widen>(w, row_bytes, rows, a, out) }
}

/// [`group_core`] with base Advanced SIMD.
///
/// # Safety
/// None beyond aarch64.
pub(super) unsafe fn group_neon<const N: usize>(w: &[BlockQ4_0], a: [&Q8Act; N]) -> [f32; N] {
    // SAFETY: the caller's.
    unsafe { group_core::<Widen, N>(w, a) }
}

/// [`dot_neon`] with `sdot`.
///
/// # Safety
/// The CPU has FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn dot_dotprod(w: &[BlockQ4_0], a: &Q8Act) -> f32 {
    // SAFETY: the caller's.
    unsafe { dot_core::<Sdot>(w, a) }
}

/// [`rows_neon`] with `sdot`.
///
/// # Safety
/// As [`dot_dotprod`] and [`rows_neon`].
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn rows_dotprod(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    // SAFETY: the caller's.
    unsafe { rows_core::<Sdot>(w, row_bytes, rows, a, out) }
}

/// [`group_neon`] with `sdot`.
///
/// # Safety
/// As [`dot_dotprod`].
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn group_dotprod<const N: usize>(w: &[BlockQ4_0], a: [&Q8Act; N]) -> [f32; N] {
    // SAFETY: the caller's.
    unsafe { group_core::<Sdot, N>(w, a) }
}

/// Pairs of rows against pairs of tokens with `smmla` (i8mm): each `smmla` takes 8 values of
/// 2 rows and of 2 tokens and leaves the 4 (row, token) dots, so the 4 lanes of one
/// accumulator are 4 chains, each one fused step per block in block order (the bits of
/// [`dot_core`]).
mod mm {
    use super::*;

    /// A token pair's block: the 4 vectors `smmla` takes (bytes 8c..8c+8 of token 0, then of
    /// token 1, for c = 0..4) and `[d_0, d_1, d_0, d_1]`.
    #[derive(Copy, Clone)]
    pub(super) struct PairBlock {
        q: [int8x16_t; 4],
        d: float32x4_t,
    }

    thread_local! {
        /// The token pairs of the current call, packed (pair-major).
        static PACKED: std::cell::RefCell<Vec<PairBlock>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// Packs tokens `t0` and `t1` (the same token twice for an odd last one).
    fn pack(a0: &Q8Act, a1: &Q8Act, nb: usize, out: &mut Vec<PairBlock>) {
        for i in 0..nb {
            let (y0, y1) = (act(a0, i), act(a1, i));
            // SAFETY: base Advanced SIMD, register-only.
            let p = unsafe {
                let z = |u: int8x16_t, v: int8x16_t, hi: bool| {
                    let (u, v) = (vreinterpretq_s64_s8(u), vreinterpretq_s64_s8(v));
                    vreinterpretq_s8_s64(if hi {
                        vzip2q_s64(u, v)
                    } else {
                        vzip1q_s64(u, v)
                    })
                };
                let d0 = arm::f16_to_f32(a0.blocks[i].d);
                let d1 = arm::f16_to_f32(a1.blocks[i].d);
                let dd = vcombine_f32(
                    vset_lane_f32::<1>(d1, vdup_n_f32(d0)),
                    vset_lane_f32::<1>(d1, vdup_n_f32(d0)),
                );
                PairBlock {
                    q: [
                        z(y0[0], y1[0], false),
                        z(y0[0], y1[0], true),
                        z(y0[1], y1[1], false),
                        z(y0[1], y1[1], true),
                    ],
                    d: dd,
                }
            };
            out.push(p);
        }
    }

    /// Two rows against one packed token pair: `[r0·t0, r0·t1, r1·t0, r1·t1]`.
    #[target_feature(enable = "i8mm")]
    #[inline]
    unsafe fn rows2(w: [&[BlockQ4_0]; 2], p: &[PairBlock]) -> float32x4_t {
        // SAFETY (the whole body): i8mm is present (this function's contract).
        unsafe {
            let mut run = vdupq_n_s32(0);
            let mut acc = vdupq_n_f32(0.0);
            let zip = |u: int8x16_t, v: int8x16_t| {
                let (u, v) = (vreinterpretq_s64_s8(u), vreinterpretq_s64_s8(v));
                [
                    vreinterpretq_s8_s64(vzip1q_s64(u, v)),
                    vreinterpretq_s8_s64(vzip2q_s64(u, v)),
                ]
            };
            for (i, p) in p.iter().enumerate() {
                let (q0, q1) = (levels(&w[0][i]), levels(&w[1][i]));
                let lo = zip(q0[0], q1[0]);
                let hi = zip(q0[1], q1[1]);
                let s = arm::smmla(
                    arm::smmla(
                        arm::smmla(arm::smmla(run, lo[0], p.q[0]), lo[1], p.q[1]),
                        hi[0],
                        p.q[2],
                    ),
                    hi[1],
                    p.q[3],
                );
                let blk = vsubq_s32(s, run);
                run = s;
                let dw = vcombine_f32(
                    vdup_n_f32(arm::f16_to_f32(w[0][i].d)),
                    vdup_n_f32(arm::f16_to_f32(w[1][i].d)),
                );
                acc = vfmaq_f32(acc, vcvtq_f32_s32(blk), vmulq_f32(dw, p.d));
            }
            acc
        }
    }

    /// Rows `rows` against `a` (at most `WIDE` tokens), as [`super::super::format::GroupFn`].
    ///
    /// # Safety
    /// The CPU has FEAT_I8MM; `rows` lie inside `w`; `out[t].len() == rows.len()`.
    #[target_feature(enable = "i8mm,dotprod")]
    pub(in super::super) unsafe fn wide(
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
        a: &[&ActBuf],
        out: &mut [&mut [f32]],
    ) {
        use super::super::super::format::Activation;
        use super::super::super::q8_0::ActQ8_0;
        let views: Vec<&Q8Act> = a.iter().map(|a| ActQ8_0::view(a)).collect();
        let nb = views
            .iter()
            .fold(row_bytes / std::mem::size_of::<BlockQ4_0>(), |n, v| {
                n.min(v.blocks.len())
            });
        let row =
            |r: usize| -> &[BlockQ4_0] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
        PACKED.with(|cell| {
            let packed = &mut *cell.borrow_mut();
            packed.clear();
            let n_pairs = views.len().div_ceil(2);
            for p in 0..n_pairs {
                let t1 = (2 * p + 1).min(views.len() - 1);
                pack(views[2 * p], views[t1], nb, packed);
            }
            let first = rows.start;
            let mut r = rows.start;
            while r + 2 <= rows.end {
                prefetch_lines(w, (r + 2) * row_bytes, 2 * row_bytes);
                for p in 0..n_pairs {
                    // SAFETY: i8mm is present (this function's contract).
                    let v = unsafe { rows2([row(r), row(r + 1)], &packed[p * nb..(p + 1) * nb]) };
                    let mut l = [0f32; 4];
                    // SAFETY: 4 floats.
                    unsafe { vst1q_f32(l.as_mut_ptr(), v) };
                    out[2 * p][r - first] = l[0];
                    out[2 * p][r + 1 - first] = l[2];
                    if 2 * p + 1 < views.len() {
                        out[2 * p + 1][r - first] = l[1];
                        out[2 * p + 1][r + 1 - first] = l[3];
                    }
                }
                r += 2;
            }
            if r < rows.end {
                for (t, v) in views.iter().enumerate() {
                    // SAFETY: dotprod is present (i8mm cores have it; the level includes it).
                    out[t][r - first] = unsafe { dot_core::<Sdot>(row(r), v) };
                }
            }
        });
    }
}

pub(super) use mm::wide as wide_i8mm;

const _: () = assert!(QK == 32);
