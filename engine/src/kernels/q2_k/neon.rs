//! Q2_K on aarch64: the one-token and grouped dots at the NEON and dotprod levels and the
//! `smmla` prefill kernel at i8mm.
//!
//! Why this shape: as Q6_K's (`q6_k/neon.rs`, whose 16-value products and token packing these
//! share): values `16j .. 16j + 16` of a half are one run and four of the scalar order's 8
//! lanes, so per run one 16-value product (`sdot`, or `smull` + pairwise adds) into a running
//! sum and one `mla` by the telescoped 4-bit scales (`q6_k::neon::half_sums`); the minimums'
//! lane terms `m_2k·bsum_2k + m_2k+1·bsum_2k+1` come from the block sums; all are converted
//! to f32 by the `1.5 · 2^23` trick (`q6_k::neon::from_magic`); then the scalar's two fused
//! multiply-adds per lane (minimums first) and the [`reduce8`] tree: the bits of
//! [`super::dot_scalar`]. At i8mm a level times its run's scale fits a byte (≤ 45), so each
//! row pair is unpacked once per call into those products laid out for `smmla` (8 bytes =
//! lane `k` of two groups) and each lane's exact sum over 2 rows × 2 tokens is 4 `smmla`.

use super::super::format::{Activation, Dotprod, I8mm, Kernel, Neon};
use super::super::neon::{f16_to_f32, reduce8, smmla};
use super::super::q6_k::neon::{
    fold_tile, from_magic, half_sums, lane_rows, mm_tokens, pair_runs, run_multipliers_i8, ByMull,
    BySdot, Dot16, MmTokens, MAGIC,
};
use super::super::q8_k::{by_row_steps, ActQ8K, BlockQ8K, PackRing, WIDE};
use super::super::{blocks, ActBuf};
use super::{BlockQ2K, Q2K};
use std::arch::aarch64::*;
use std::ops::Range;

/// The levels (0..=3) of half `n` (< 2) of `x`: vector `j` holds values `128n + 16j ..
/// 128n + 16j + 16` (run `8n + j`).
#[inline(always)]
unsafe fn levels(x: &BlockQ2K, n: usize) -> [int8x16_t; 8] {
    // SAFETY: 32 bytes inside qs (64) as n < 2; the rest is register-only.
    unsafe {
        let q = vld1q_u8_x2(x.qs.as_ptr().add(32 * n));
        let m3 = vdupq_n_u8(3);
        [
            vandq_u8(q.0, m3),
            vandq_u8(q.1, m3),
            vandq_u8(vshrq_n_u8::<2>(q.0), m3),
            vandq_u8(vshrq_n_u8::<2>(q.1), m3),
            vandq_u8(vshrq_n_u8::<4>(q.0), m3),
            vandq_u8(vshrq_n_u8::<4>(q.1), m3),
            vshrq_n_u8::<6>(q.0),
            vshrq_n_u8::<6>(q.1),
        ]
        .map(|v| vreinterpretq_s8_u8(v))
    }
}

/// Per activation block, the minimums' lane terms and the exact lane sums (lanes 0–3,
/// 4–7) of one super-block, each plus [`MAGIC`] (≤ 2 · 15 · 2032 and 32 · 45 · 127 in
/// magnitude: inside its range), the weights decoded once for all.
#[inline(always)]
unsafe fn block_sums<D: Dot16, const N: usize>(
    x: &BlockQ2K,
    y: [&BlockQ8K; N],
) -> [([int32x4_t; 2], [int32x4_t; 2]); N] {
    // SAFETY (every block): 16 bytes of scales, 32 of bsums; the rest is register-only; the
    // caller's level.
    unsafe {
        let packed = vld1q_u8(x.scales.as_ptr());
        let sc = vandq_u8(packed, vdupq_n_u8(0x0f));
        let mins = vshrq_n_u8::<4>(packed);
        let m16 =
            [vmovl_u8(vget_low_u8(mins)), vmovl_high_u8(mins)].map(|v| vreinterpretq_s16_u16(v));
        let mult = run_multipliers_i8(vreinterpretq_s8_u8(sc));
        // Offset by MAGIC for the conversion (see `from_magic`).
        let mut acc = [[vdupq_n_s32(MAGIC); 2]; N];
        let mut p = [[vdupq_n_s32(0); 2]; N];
        for n in 0..2 {
            half_sums::<D, N>(&levels(x, n), y, n, &mult, &mut p, &mut acc);
        }
        std::array::from_fn(|t| {
            let bs = vld1q_s16_x2(y[t].bsums.as_ptr());
            let m = [
                vpaddq_s32(
                    vmull_s16(vget_low_s16(m16[0]), vget_low_s16(bs.0)),
                    vmull_high_s16(m16[0], bs.0),
                ),
                vpaddq_s32(
                    vmull_s16(vget_low_s16(m16[1]), vget_low_s16(bs.1)),
                    vmull_high_s16(m16[1], bs.1),
                ),
            ];
            (m.map(|m| vaddq_s32(m, vdupq_n_s32(MAGIC))), acc[t])
        })
    }
}

/// `N` dots of one row (the scalar order for each), each block decoded once.
#[inline(always)]
unsafe fn dot_n<D: Dot16, const N: usize>(w: &[BlockQ2K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
    // Every row cut to n blocks: no bounds checks in the loop.
    let a = a.map(|a| &a[..n]);
    // SAFETY (every intrinsic): register-only base Advanced SIMD; the caller's level.
    unsafe {
        let mut lanes = [[vdupq_n_f32(0.0); 2]; N];
        for (i, x) in w[..n].iter().enumerate() {
            let y: [&BlockQ8K; N] = std::array::from_fn(|t| &a[t][i]);
            let s = block_sums::<D, N>(x, y);
            let (xd, xdmin) = (f16_to_f32(x.d), f16_to_f32(x.dmin));
            for t in 0..N {
                let (d, dmin) = (y[t].d * xd, -y[t].d * xdmin);
                let (m, sumi) = s[t];
                for k in 0..2 {
                    lanes[t][k] = vfmaq_n_f32(lanes[t][k], from_magic(m[k]), dmin);
                    lanes[t][k] = vfmaq_n_f32(lanes[t][k], from_magic(sumi[k]), d);
                }
            }
        }
        lanes.map(|l| reduce8(l[0], l[1]))
    }
}

#[target_feature(enable = "dotprod")]
unsafe fn dot_n_dotprod<const N: usize>(w: &[BlockQ2K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    // SAFETY: dotprod is present (this function's feature).
    unsafe { dot_n::<BySdot, N>(w, a) }
}

impl Kernel<Q2K> for Neon {
    unsafe fn dot(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: base Advanced SIMD only.
        let [v] = unsafe { dot_n::<ByMull, 1>(w, [a]) };
        v
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ2K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: base Advanced SIMD only.
        unsafe { dot_n::<ByMull, N>(w, a) }
    }
}

impl Kernel<Q2K> for Dotprod {
    unsafe fn dot(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (dotprod is present).
        let [v] = unsafe { dot_n_dotprod::<1>(w, [a]) };
        v
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ2K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n_dotprod::<N>(w, a) }
    }
}

impl Kernel<Q2K> for I8mm {
    unsafe fn dot(w: &[BlockQ2K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (i8mm includes dotprod).
        let [v] = unsafe { dot_n_dotprod::<1>(w, [a]) };
        v
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ2K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n_dotprod::<N>(w, a) }
    }

    const WIDE: bool = true;

    /// llvm-mca (Neoverse N2 / V1), cycles per row and super-block at 4 tokens: one call 110
    /// / 53 (the row pair's unpacking, 113 / 52, included), the dotprod group of 4 145 / 72;
    /// at 3 tokens the group of 3 is as fast (107 / 52).
    const WIDE_MIN: usize = 4;

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

/// A row pair's super-blocks unpacked once per call for [`pair_tokens`]:
/// - `w[(8b + k) · 4 + p]`: `sc · q` as [`lane_rows`] lays it out (lane `k`, groups `2p`,
///   `2p + 1`);
/// - `mins[8b + k]`: the minimums as i16 `[r0, r0, r1, r1]` of run `2k`, then of run `2k + 1`;
/// - `d[b]`, `dmin[b]`: the rows' scales `[r0, r0, r1, r1]`.
#[derive(Default)]
struct Q2Pair {
    w: Vec<[i8; 16]>,
    mins: Vec<[i16; 8]>,
    d: Vec<[f32; 4]>,
    dmin: Vec<[f32; 4]>,
}

/// Unpacks rows `x[0]`, `x[1]` into `u`.
#[inline(never)]
fn unpack_pair(x: [&[BlockQ2K]; 2], u: &mut Q2Pair) {
    let nb = x[0].len().min(x[1].len());
    u.w.resize(nb * 32, [0; 16]);
    u.mins.resize(nb * 8, [0; 8]);
    u.d.resize(nb, [0.0; 4]);
    u.dmin.resize(nb, [0.0; 4]);
    for b in 0..nb {
        let xb = [&x[0][b], &x[1][b]];
        let wb = &mut u.w[32 * b..32 * b + 32];
        // SAFETY (every intrinsic): base Advanced SIMD; 16-byte stores into `wb` (32 entries,
        // indices below 32).
        unsafe {
            for n in 0..2 {
                // Runs 8n .. 8n + 8 (group pairs 2n, 2n + 1) of both rows: [row][run].
                let mut scaled = [[vdupq_n_s8(0); 8]; 2];
                for (r, x) in xb.iter().enumerate() {
                    let v = levels(x, n);
                    for j in 0..8 {
                        // ≤ 3 · 15: one byte.
                        let sc = vdupq_n_s8((x.scales[8 * n + j] & 0x0f) as i8);
                        scaled[r][j] = vmulq_s8(v[j], sc);
                    }
                }
                for half in 0..2 {
                    let p = 2 * n + half;
                    let g = [0, 1].map(|r| {
                        let v = &scaled[r];
                        [
                            v[4 * half],
                            v[4 * half + 1],
                            v[4 * half + 2],
                            v[4 * half + 3],
                        ]
                    });
                    for (k, v) in lane_rows(g).into_iter().enumerate() {
                        vst1q_s8(wb[4 * k + p].as_mut_ptr(), v);
                    }
                }
            }
        }
        // SAFETY (every intrinsic): base Advanced SIMD; a 16-byte load of scales; 16-byte
        // stores into `u.mins` at 8b + k < its length.
        unsafe {
            let v = xb.map(|x| {
                let m = vshrq_n_u8::<4>(vld1q_u8(x.scales.as_ptr()));
                [vmovl_u8(vget_low_u8(m)), vmovl_high_u8(m)].map(|h| vreinterpretq_s16_u16(h))
            });
            for (k, v) in pair_runs(v).into_iter().enumerate() {
                vst1q_s16(u.mins[8 * b + k].as_mut_ptr(), v);
            }
        }
        let d = xb.map(|x| f16_to_f32(x.d));
        let dmin = xb.map(|x| f16_to_f32(x.dmin));
        u.d[b] = [d[0], d[0], d[1], d[1]];
        u.dmin[b] = [dmin[0], dmin[0], dmin[1], dmin[1]];
    }
}

/// Token pairs `tp0 .. tp0 + TPN` of `l` against the unpacked row pair `u` (`nb` blocks):
/// per pair the 8 lane accumulators of the 2 × 2 (rows × tokens) results, folded.
#[target_feature(enable = "dotprod,i8mm")]
#[inline]
unsafe fn pair_tokens<const TPN: usize>(
    u: &Q2Pair,
    l: &MmTokens,
    tp0: usize,
    nb: usize,
) -> [[f32; 4]; TPN] {
    let pairs = l.pairs;
    debug_assert!(tp0 + TPN <= pairs && u.w.len() >= nb * 32 && l.qs.len() >= nb * 32 * pairs);
    // SAFETY: every index below is inside its vector by the lengths above (`w`: 32 per block,
    // `mins`: 8, `d`, `dmin`: 1; `qs`: 32 · pairs per block, `bs`: 8 · pairs, `d`: pairs);
    // i8mm and dotprod are present (this function's features).
    unsafe {
        let mut f = [[vdupq_n_f32(0.0); 8]; TPN];
        for b in 0..nb {
            let dx = vld1q_f32(u.d.get_unchecked(b).as_ptr());
            let dmx = vld1q_f32(u.dmin.get_unchecked(b).as_ptr());
            let dy: [float32x4_t; TPN] =
                std::array::from_fn(|i| vld1q_f32(l.d.get_unchecked(b * pairs + tp0 + i).as_ptr()));
            // The scalar's d = d_a · d and dmin = −d_a · dmin, per (row, token).
            let d = dy.map(|dy| vmulq_f32(dy, dx));
            let dmin = dy.map(|dy| vmulq_f32(vnegq_f32(dy), dmx));
            for k in 0..8 {
                let wp = u.w.as_ptr().add((8 * b + k) * 4).cast::<i8>();
                let mins = vld1q_s16(u.mins.get_unchecked(8 * b + k).as_ptr());
                for (i, f) in f.iter_mut().enumerate() {
                    let at = (8 * b + k) * pairs + tp0 + i;
                    let bp = l.qs.as_ptr().add(4 * at).cast::<i8>();
                    let bs = vld1q_s16(l.bs.get_unchecked(at).as_ptr());
                    // Both integers offset by MAGIC for the conversion (see `from_magic`).
                    let m = vmlal_s16(vdupq_n_s32(MAGIC), vget_low_s16(mins), vget_low_s16(bs));
                    let m = vmlal_high_s16(m, mins, bs);
                    f[k] = vfmaq_f32(f[k], from_magic(m), dmin[i]);
                    let mut acc = vdupq_n_s32(MAGIC);
                    for p in 0..4 {
                        acc = smmla(acc, vld1q_s8(wp.add(16 * p)), vld1q_s8(bp.add(16 * p)));
                    }
                    f[k] = vfmaq_f32(f[k], from_magic(acc), d[i]);
                }
            }
        }
        f.map(|f| fold_tile(&f))
    }
}

thread_local! {
    /// The packed tokens and the unpacked row pair of the current call.
    static MM: std::cell::RefCell<(PackRing<MmTokens>, Q2Pair)> =
        std::cell::RefCell::new((PackRing::default(), Q2Pair::default()));
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
    let nb = row_bytes / std::mem::size_of::<BlockQ2K>();
    let nb = a.iter().fold(nb, |n, a| n.min(ActQ8K::view(a).len()));
    MM.with(|cell| {
        let (ring, u) = &mut *cell.borrow_mut();
        let l = mm_tokens(ring, a, nb);
        let row =
            |r: usize| -> &[BlockQ2K] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
        by_row_steps::<2>(w, row_bytes, rows, out, |r, n| {
            unpack_pair([row(r), row(r + n - 1)], u);
            let mut v = [[0f32; WIDE]; 2];
            let put = |v: &mut [[f32; WIDE]; 2], tp: usize, o: [f32; 4]| {
                (v[0][2 * tp], v[0][2 * tp + 1]) = (o[0], o[1]);
                (v[1][2 * tp], v[1][2 * tp + 1]) = (o[2], o[3]);
            };
            let mut tp = 0;
            while tp < l.pairs {
                // SAFETY: the caller's (i8mm is present); tp + 2 or + 1 ≤ pairs.
                if l.pairs - tp >= 2 {
                    let o = unsafe { pair_tokens::<2>(u, l, tp, nb) };
                    put(&mut v, tp, o[0]);
                    put(&mut v, tp + 1, o[1]);
                    tp += 2;
                } else {
                    let [o] = unsafe { pair_tokens::<1>(u, l, tp, nb) };
                    put(&mut v, tp, o);
                    tp += 1;
                }
            }
            v
        });
    });
}
