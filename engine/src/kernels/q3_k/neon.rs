//! Q3_K on aarch64: the one-token and grouped dots at the NEON and dotprod levels and the
//! `smmla` prefill kernel at i8mm.
//!
//! Why this shape: as Q6_K's (`q6_k/neon.rs`, whose 16-value products and token packing these
//! share): values `16j .. 16j + 16` of a half are one run and four of the scalar order's 8
//! lanes, so per run one 16-value product of the signed levels (`low − 4` where the high bit
//! is clear: −4..=3) into a running sum and one `mla` by the telescoped run scales `sc − 32`
//! (`q6_k::neon::half_sums`), converted to f32 by the `1.5 · 2^23` trick
//! (`q6_k::neon::from_magic`); then the scalar's fused
//! multiply-add per lane and the [`reduce8`] tree: the bits of [`super::dot_scalar`]. At
//! i8mm each row pair is unpacked once per call into the signed bytes `−(sc − 32) · q`
//! (−128..=124: `(sc − 32) · q` itself reaches +128) laid out for `smmla` (8 bytes = lane `k`
//! of two groups), so 4 `smmla` give each lane's exact sum, negated, over 2 rows × 2 tokens;
//! `fmls` by the negated sum is the scalar's `fma` (the negations are exact, one rounding
//! either way).

use super::super::format::{Activation, Dotprod, I8mm, Kernel, Neon};
use super::super::neon::{f16_to_f32, reduce8, smmla};
use super::super::q6_k::neon::{
    fold_tile, from_magic, half_sums, lane_rows, mm_tokens, run_multipliers_i8, ByMull, BySdot,
    Dot16, MmTokens, MAGIC,
};
use super::super::q8_k::{by_row_steps, ActQ8K, BlockQ8K, PackRing, WIDE};
use super::super::{blocks, ActBuf};
use super::{scale_words, BlockQ3K, Q3K};
use std::arch::aarch64::*;
use std::ops::Range;

/// The 16 run scales as stored (0..=63; the value's scale is this − 32), straight into a
/// register (a byte array through memory would stall the vector load on store forwarding).
#[inline(always)]
fn scales(x: &BlockQ3K) -> uint8x16_t {
    let w = scale_words(&x.scales);
    let lo = w[0] as u64 | (w[1] as u64) << 32;
    let hi = w[2] as u64 | (w[3] as u64) << 32;
    // SAFETY: register-only base Advanced SIMD.
    unsafe { vreinterpretq_u8_u64(vcombine_u64(vcreate_u64(lo), vcreate_u64(hi))) }
}

/// The levels (−4..=3) of half `N` (< 2) of `x`: vector `j` holds values `128N + 16j ..
/// 128N + 16j + 16` (run `8N + j`). `hm` is the `hmask` (its two 16-byte halves): 4 is
/// subtracted where the value's high bit (`4N + j / 2`) is clear. (`N` a constant: each
/// group's shift is then one instruction, not a branch.)
#[inline(always)]
unsafe fn levels<const N: usize>(x: &BlockQ3K, hm: [uint8x16_t; 2]) -> [int8x16_t; 8] {
    const { assert!(N < 2) };
    let n = N;
    // SAFETY: 32 bytes inside qs (64) as n < 2; the rest is register-only.
    unsafe {
        let q = vld1q_u8_x2(x.qs.as_ptr().add(32 * n));
        let q = [q.0, q.1];
        let (m3, m4) = (vdupq_n_u8(3), vdupq_n_u8(4));
        std::array::from_fn(|j| {
            let (t, half) = (j / 2, j % 2);
            let low = match t {
                0 => vandq_u8(q[half], m3),
                1 => vandq_u8(vshrq_n_u8::<2>(q[half]), m3),
                2 => vandq_u8(vshrq_n_u8::<4>(q[half]), m3),
                _ => vshrq_n_u8::<6>(q[half]),
            };
            // Bit 4n + t of the mask moved to bit 2 and cleared from 4: 4 where it is clear.
            let h = hm[half];
            let four = vbicq_u8(
                m4,
                match 4 * n + t {
                    0 => vshlq_n_u8::<2>(h),
                    1 => vshlq_n_u8::<1>(h),
                    2 => h,
                    3 => vshrq_n_u8::<1>(h),
                    4 => vshrq_n_u8::<2>(h),
                    5 => vshrq_n_u8::<3>(h),
                    6 => vshrq_n_u8::<4>(h),
                    _ => vshrq_n_u8::<5>(h),
                },
            );
            vreinterpretq_s8_u8(vsubq_u8(low, four))
        })
    }
}

/// The high-bit mask of `x`, as [`levels`] takes it.
#[inline(always)]
unsafe fn hmask(x: &BlockQ3K) -> [uint8x16_t; 2] {
    // SAFETY: 32 bytes of hmask.
    unsafe {
        let h = vld1q_u8_x2(x.hmask.as_ptr());
        [h.0, h.1]
    }
}

/// The exact lane sums (lanes 0–3, 4–7) of one super-block against `N` activation blocks,
/// plus [`MAGIC`], the weights decoded once for all.
#[inline(always)]
unsafe fn block_sums<D: Dot16, const N: usize>(
    x: &BlockQ3K,
    y: [&BlockQ8K; N],
) -> [[int32x4_t; 2]; N] {
    // SAFETY (every block): register-only base Advanced SIMD; the caller's level.
    unsafe {
        let sc = vsubq_s8(vreinterpretq_s8_u8(scales(x)), vdupq_n_s8(32));
        let mult = run_multipliers_i8(sc);
        let hm = hmask(x);
        // Offset by MAGIC for the conversion (see `from_magic`; ≤ 32 · 128 · 127).
        let mut acc = [[vdupq_n_s32(MAGIC); 2]; N];
        let mut p = [[vdupq_n_s32(0); 2]; N];
        half_sums::<D, N>(&levels::<0>(x, hm), y, 0, &mult, &mut p, &mut acc);
        half_sums::<D, N>(&levels::<1>(x, hm), y, 1, &mult, &mut p, &mut acc);
        acc
    }
}

/// `N` dots of one row (the scalar order for each), each block decoded once.
#[inline(always)]
unsafe fn dot_n<D: Dot16, const N: usize>(w: &[BlockQ3K], a: [&[BlockQ8K]; N]) -> [f32; N] {
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
                    lanes[t][k] = vfmaq_n_f32(lanes[t][k], from_magic(s[t][k]), d);
                }
            }
        }
        lanes.map(|l| reduce8(l[0], l[1]))
    }
}

#[target_feature(enable = "dotprod")]
unsafe fn dot_n_dotprod<const N: usize>(w: &[BlockQ3K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    // SAFETY: dotprod is present (this function's feature).
    unsafe { dot_n::<BySdot, N>(w, a) }
}

impl Kernel<Q3K> for Neon {
    unsafe fn dot(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: base Advanced SIMD only.
        let [v] = unsafe { dot_n::<ByMull, 1>(w, [a]) };
        v
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ3K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: base Advanced SIMD only.
        unsafe { dot_n::<ByMull, N>(w, a) }
    }
}

impl Kernel<Q3K> for Dotprod {
    unsafe fn dot(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (dotprod is present).
        let [v] = unsafe { dot_n_dotprod::<1>(w, [a]) };
        v
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ3K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n_dotprod::<N>(w, a) }
    }
}

impl Kernel<Q3K> for I8mm {
    unsafe fn dot(w: &[BlockQ3K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (i8mm includes dotprod).
        let [v] = unsafe { dot_n_dotprod::<1>(w, [a]) };
        v
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ3K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n_dotprod::<N>(w, a) }
    }

    const WIDE: bool = true;

    /// llvm-mca (Neoverse N2 / V1), cycles per row and super-block at 4 tokens: one call 123
    /// / 65 (the row pair's unpacking, 180 / 86, included), the dotprod group of 4 148 / 73;
    /// at 3 tokens the group of 3 is faster (119 / 59).
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
/// - `w[(8b + k) · 4 + p]`: `−(sc − 32) · q` as [`lane_rows`] lays it out (lane `k`, groups
///   `2p`, `2p + 1`);
/// - `d[b]`: the rows' scales `[r0, r0, r1, r1]`.
#[derive(Default)]
struct Q3Pair {
    w: Vec<[i8; 16]>,
    d: Vec<[f32; 4]>,
}

/// Unpacks rows `x[0]`, `x[1]` into `u`.
#[inline(never)]
fn unpack_pair(x: [&[BlockQ3K]; 2], u: &mut Q3Pair) {
    let nb = x[0].len().min(x[1].len());
    u.w.resize(nb * 32, [0; 16]);
    u.d.resize(nb, [0.0; 4]);
    for b in 0..nb {
        let xb = [&x[0][b], &x[1][b]];
        let wb = &mut u.w[32 * b..32 * b + 32];
        // SAFETY (every intrinsic): base Advanced SIMD; 16-byte stores into `wb` (32 entries,
        // indices below 32) and into a 16-byte array.
        unsafe {
            // Per row, 32 − sc (−31..=32), the negated run scales.
            let mut neg = [[0i8; 16]; 2];
            for (r, x) in xb.iter().enumerate() {
                let v = vsubq_s8(vdupq_n_s8(32), vreinterpretq_s8_u8(scales(x)));
                vst1q_s8(neg[r].as_mut_ptr(), v);
            }
            let hm = xb.map(|x| hmask(x));
            for n in 0..2 {
                // Runs 8n .. 8n + 8 (group pairs 2n, 2n + 1) of both rows: [row][run].
                let mut scaled = [[vdupq_n_s8(0); 8]; 2];
                for (r, x) in xb.iter().enumerate() {
                    let v = if n == 0 {
                        levels::<0>(x, hm[r])
                    } else {
                        levels::<1>(x, hm[r])
                    };
                    for j in 0..8 {
                        // −(sc − 32) · q in −128..=124: exact in a byte.
                        scaled[r][j] = vmulq_s8(v[j], vld1q_dup_s8(&neg[r][8 * n + j]));
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
        let d = xb.map(|x| f16_to_f32(x.d));
        u.d[b] = [d[0], d[0], d[1], d[1]];
    }
}

/// Token pairs `tp0 .. tp0 + TPN` of `l` against the unpacked row pair `u` (`nb` blocks):
/// per pair the 8 lane accumulators of the 2 × 2 (rows × tokens) results, folded.
#[target_feature(enable = "dotprod,i8mm")]
#[inline]
unsafe fn pair_tokens<const TPN: usize>(
    u: &Q3Pair,
    l: &MmTokens,
    tp0: usize,
    nb: usize,
) -> [[f32; 4]; TPN] {
    let pairs = l.pairs;
    debug_assert!(tp0 + TPN <= pairs && u.w.len() >= nb * 32 && l.qs.len() >= nb * 32 * pairs);
    // SAFETY: every index below is inside its vector by the lengths above (`w`: 32 per block,
    // `d`: 1; `qs`: 32 · pairs per block, `d`: pairs); i8mm and dotprod are present (this
    // function's features).
    unsafe {
        let mut f = [[vdupq_n_f32(0.0); 8]; TPN];
        for b in 0..nb {
            let dx = vld1q_f32(u.d.get_unchecked(b).as_ptr());
            let d: [float32x4_t; TPN] = std::array::from_fn(|i| {
                vmulq_f32(
                    vld1q_f32(l.d.get_unchecked(b * pairs + tp0 + i).as_ptr()),
                    dx,
                )
            });
            for k in 0..8 {
                let wp = u.w.as_ptr().add((8 * b + k) * 4).cast::<i8>();
                for (i, f) in f.iter_mut().enumerate() {
                    let bp =
                        l.qs.as_ptr()
                            .add(4 * ((8 * b + k) * pairs + tp0 + i))
                            .cast::<i8>();
                    // Offset by MAGIC for the conversion (see `from_magic`).
                    let mut acc = vdupq_n_s32(MAGIC);
                    for p in 0..4 {
                        acc = smmla(acc, vld1q_s8(wp.add(16 * p)), vld1q_s8(bp.add(16 * p)));
                    }
                    // acc = MAGIC − sumi: lane − d · (−sumi) is the scalar's fma(d, sumi, lane).
                    f[k] = vfmsq_f32(f[k], from_magic(acc), d[i]);
                }
            }
        }
        f.map(|f| fold_tile(&f))
    }
}

thread_local! {
    /// The packed tokens and the unpacked row pair of the current call.
    static MM: std::cell::RefCell<(PackRing<MmTokens>, Q3Pair)> =
        std::cell::RefCell::new((PackRing::default(), Q3Pair::default()));
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
    let nb = row_bytes / std::mem::size_of::<BlockQ3K>();
    let nb = a.iter().fold(nb, |n, a| n.min(ActQ8K::view(a).len()));
    MM.with(|cell| {
        let (ring, u) = &mut *cell.borrow_mut();
        let l = mm_tokens(ring, a, nb);
        let row =
            |r: usize| -> &[BlockQ3K] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
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
