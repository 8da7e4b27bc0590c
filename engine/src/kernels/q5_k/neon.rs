//! Q5_K on aarch64: the NEON (`smull`), dotprod (`sdot`) and i8mm (`usmmla`, prefill) levels.
//!
//! Why this exists: Q5_K holds the attention outputs of Q4_K_M files. Its order keeps 8 lane
//! sums (values `4k .. 4k + 4` of every 32 in lane `k`), which is exactly where `sdot` puts
//! them: the first 16 values of a sub-block land in lanes 0–3, the second 16 in lanes 4–7.
//! Each lane's `Σ_j sc_j · P_j` is taken by summation by parts: one running `sdot` chain per
//! half block (no fresh zero per sub-block), and after sub-block `j` one `mla` of the running
//! sum by `sc_j − sc_j+1` (`sc_8 = 0`) — the same exact integer, in wrapping i32 arithmetic
//! whose true result fits. Then the scalar's float steps: one `fmla` per half of the 8 lanes,
//! the minimums' scalar fused chain, `reduce8(lanes) + m_sum`: the bits of
//! [`super::dot_scalar`].
//!
//! The fifth bit of value `64c + l` is bit `2c` of `qh[l]` (`32 + l`: bit `2c + 1`): with `qh`
//! shifted right by `2c`, `sli` puts bit 0 over the low nibble and `sri` the high nibble under
//! bit 1 (moved to bit 4), two or three instructions per 16 values.
//!
//! i8mm (prefill, [`dot_wide`]): an `smmla` sum of 8 products may only gather values of one
//! lane of the scalar order, and a lane has 4 values per sub-block: with the scales applied
//! after the matrix multiply (Q4_K's way) half of every 8-deep product would be wasted, no
//! better than `sdot`. So the scales go into the weights instead: `sc = s0 + 8 · s1` (both
//! 0..=7), and `q · s0`, `q · s1` (≤ 31 · 7) are bytes. Then a lane is one plain dot product
//! over its 32 values (4 of each sub-block), in which any 8 may share an `usmmla`: per lane,
//! 4 `usmmla` of the `s1` weights, a shift by 3, 4 of the `s0` weights give the lane's exact
//! integer for 2 rows × 2 tokens, with no multiply by a scale per sub-block. The weights are
//! built once per row pair and call (in a scratch the token pairs reread), the tokens packed
//! once per call ([`Pairs`]); the float steps are the scalar's, one lane vector per lane.

use super::super::format::{Activation, Dotprod, I8mm, Kernel, Neon};
use super::super::neon::{f16x4_to_f32, reduce8, sdot, smmla, usmmla};
use super::super::q4_k::neon::{
    lane_diffs, mins_lanes, mla_lane, mul_lane, scale_bytes, scale_words, spill, spread_bytes,
    super_scales, super_scales_bits, vector_of, Pairs,
};
use super::super::q8_k::{by_row_steps, ActQ8K, BlockQ8K, PackRing, WIDE};
use super::super::{blocks, ActBuf};
use super::{BlockQ5K, Q5K};
use std::arch::aarch64::*;
use std::ops::Range;

/// Per block, decoded on the scalar pipes: `sc_j − sc_j+1` (`sc_8 = 0`) as i32 lanes for
/// j = 0..3 and 4..7, and the 8 minimums as i16.
///
/// # Safety
/// Base Advanced SIMD.
#[inline(always)]
unsafe fn coefficients(scales: &[u8; 12]) -> (int32x4_t, int32x4_t, int16x8_t) {
    let [w0, w1, w2, w3] = scale_words(scales);
    let (s0, s1) = (spread_bytes(w0), spread_bytes(w1));
    let d = vector_of(lane_diffs(s0, s1), lane_diffs(s1, 0));
    let m16 = vector_of(spread_bytes(w2), spread_bytes(w3));
    // SAFETY: base Advanced SIMD, register-only.
    unsafe { (vmovl_s16(vget_low_s16(d)), vmovl_high_s16(d), m16) }
}

/// The 16 head bytes of block `x` (`d`, `dmin`, `scales`).
///
/// # Safety
/// Base Advanced SIMD.
#[inline(always)]
unsafe fn head(x: &BlockQ5K) -> uint8x16_t {
    // SAFETY: the block is 176 bytes; its first 16 are d, dmin, scales.
    unsafe { vld1q_u8((x as *const BlockQ5K).cast()) }
}

/// The 5-bit values of chunk `c` from its 32 `qs` bytes `q` and `hb = qh >> 2c`: (sub-block
/// `2c`, sub-block `2c + 1`), each as two 16-byte halves.
///
/// # Safety
/// Base Advanced SIMD.
#[inline(always)]
unsafe fn chunk_values(q: uint8x16x2_t, hb: uint8x16x2_t) -> ([int8x16_t; 2], [int8x16_t; 2]) {
    // SAFETY: base Advanced SIMD, register-only.
    unsafe {
        let one = vdupq_n_u8(1);
        let two = vdupq_n_u8(2);
        // (hb & 1) << 4 | (q & 0x0F), and (q >> 4) | ((hb & 2) << 3).
        let lo = |q: uint8x16_t, h: uint8x16_t| {
            vreinterpretq_s8_u8(vsliq_n_u8::<4>(q, vandq_u8(h, one)))
        };
        let hi = |q: uint8x16_t, h: uint8x16_t| {
            vreinterpretq_s8_u8(vsriq_n_u8::<4>(vshlq_n_u8::<3>(vandq_u8(h, two)), q))
        };
        (
            [lo(q.0, hb.0), lo(q.1, hb.1)],
            [hi(q.0, hb.0), hi(q.1, hb.1)],
        )
    }
}

impl Kernel<Q5K> for Neon {
    unsafe fn dot(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: base Advanced SIMD (every aarch64 core).
        unsafe { dot_neon(w, a) }
    }
}

/// The NEON dot: per 16 values two `smull` (one product per i16 lane), `addp` to pair sums
/// (≤ 2 · 31 · 127), two `smlal` by the sub-block's scale into 8 i32 pair accumulators per
/// half; per block one `addp` folds the pairs into the 4 lanes of each half.
///
/// # Safety
/// Base Advanced SIMD.
unsafe fn dot_neon(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
    // SAFETY (every intrinsic): base Advanced SIMD; loads stay inside the blocks.
    unsafe {
        const SC16: [u8; 16] = [
            0, 255, 1, 255, 2, 255, 3, 255, 4, 255, 5, 255, 6, 255, 7, 255,
        ];
        let sc16_idx = vld1q_u8(SC16.as_ptr());
        let mut lanes = [vdupq_n_f32(0.0); 2];
        let mut m_sum = 0f32;
        for (x, y) in w.iter().zip(a) {
            let h = head(x);
            let sm = scale_bytes(h);
            let sc = vreinterpretq_s16_u8(vqtbl1q_u8(sm, sc16_idx));
            let m16 = vreinterpretq_s16_u16(vmovl_high_u8(sm));
            let mut hb = vld1q_u8_x2(x.qh.as_ptr());
            // Pair sums of values 0–15 (two vectors) and 16–31 of each sub-block.
            let mut pairs = [vdupq_n_s32(0); 4];
            macro_rules! half {
                ($w:expr, $a:expr, $l:literal, $p:literal) => {{
                    let (w, a) = ($w, $a);
                    let pl = vmull_s8(vget_low_s8(w), vget_low_s8(a));
                    let ph = vmull_high_s8(w, a);
                    let pp = vpaddq_s16(pl, ph);
                    pairs[$p] = vmlal_laneq_s16::<$l>(pairs[$p], vget_low_s16(pp), sc);
                    pairs[$p + 1] = vmlal_high_laneq_s16::<$l>(pairs[$p + 1], pp, sc);
                }};
            }
            macro_rules! chunk {
                ($c:literal, $l0:literal, $l1:literal) => {{
                    let q = vld1q_u8_x2(x.qs.as_ptr().add(32 * $c));
                    let ya = vld1q_s8_x4(y.qs.as_ptr().add(64 * $c));
                    let (lo, hi) = chunk_values(q, hb);
                    half!(lo[0], ya.0, $l0, 0);
                    half!(lo[1], ya.1, $l0, 2);
                    half!(hi[0], ya.2, $l1, 0);
                    half!(hi[1], ya.3, $l1, 2);
                    hb = uint8x16x2_t(vshrq_n_u8::<2>(hb.0), vshrq_n_u8::<2>(hb.1));
                }};
            }
            chunk!(0, 0, 1);
            chunk!(1, 2, 3);
            chunk!(2, 4, 5);
            chunk!(3, 6, 7);
            let sumi = [
                vpaddq_s32(pairs[0], pairs[1]),
                vpaddq_s32(pairs[2], pairs[3]),
            ];
            let dd = vmulq_n_f32(f16x4_to_f32(vget_low_u16(vreinterpretq_u16_u8(h))), y.d);
            let summ = vaddvq_s32(mins_lanes(m16, y));
            m_sum = (-vgetq_lane_f32::<1>(dd)).mul_add(summ as f32, m_sum);
            for (l, s) in lanes.iter_mut().zip(sumi) {
                *l = vfmaq_laneq_f32::<0>(*l, vcvtq_f32_s32(s), dd);
            }
        }
        reduce8(lanes[0], lanes[1]) + m_sum
    }
}

impl Kernel<Q5K> for Dotprod {
    unsafe fn dot(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (dotprod is present).
        let [v] = unsafe { dot_n::<1>(w, [a]) };
        v
    }

    /// Each block's 5-bit values and scales built once for all the group's tokens.
    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ5K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n::<N>(w, a) }
    }
}

impl Kernel<Q5K> for I8mm {
    unsafe fn dot(w: &[BlockQ5K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (the i8mm level includes dotprod).
        let [v] = unsafe { dot_n::<1>(w, [a]) };
        v
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ5K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n::<N>(w, a) }
    }

    const WIDE: bool = true;

    /// From 5 tokens on (llvm-mca, cycles per 256 weights and token, Neoverse N2 / V1: the
    /// lanes kernel 34.2 / 17.4 at 4 tokens, 33.4 / 17.7 at 5, 24.4 / 12.4 at 8, 19.5 / 9.8 at
    /// 16, each row pair's build (157 / 81 cycles a block) shared by all the call's tokens;
    /// the grouped dotprod kernel 32.9 / 16.1 at 4, 36.5 / 18.0 for 4 + 1).
    const WIDE_MIN: usize = 5;

    unsafe fn dot_wide(
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
        a: &[&ActBuf],
        out: &mut [&mut [f32]],
    ) {
        // SAFETY: the caller's (i8mm and dotprod are present).
        unsafe { dot_wide(w, row_bytes, rows, a, out) }
    }
}

/// One row against `N` tokens (`1 <= N <= 4`): per block the scales, their differences and
/// the 5-bit values built once; per token two running `sdot` chains (lanes 0–3, 4–7) and
/// after each sub-block two `mla` by `sc_j − sc_j+1` (see the module header).
///
/// # Safety
/// The CPU has FEAT_DotProd.
#[target_feature(enable = "dotprod")]
#[inline]
unsafe fn dot_n<const N: usize>(w: &[BlockQ5K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
    // SAFETY (every intrinsic and load): dotprod is present (the caller's); loads stay inside
    // the blocks (32 bytes at 32c of 128 qs, 32 of qh, 64 bytes at 64c of 256 activation
    // bytes, 16 head bytes).
    unsafe {
        let zero = vdupq_n_s32(0);
        let mut lanes = [[vdupq_n_f32(0.0); 2]; N];
        let mut m_sum = [0f32; N];
        for (i, x) in w[..n].iter().enumerate() {
            let (dlo, dhi, m16) = coefficients(&x.scales);
            let mut hb = vld1q_u8_x2(x.qh.as_ptr());
            // Per token: the running sums of lanes 0–3 and 4–7, and their scaled totals.
            let mut run = [[zero; 2]; N];
            let mut sumi = [[zero; 2]; N];
            macro_rules! chunk {
                ($c:literal, $d:ident, $l0:literal, $l1:literal) => {{
                    let q = vld1q_u8_x2(x.qs.as_ptr().add(32 * $c));
                    let (lo, hi) = chunk_values(q, hb);
                    for t in 0..N {
                        let ya = vld1q_s8_x4(a[t][i].qs.as_ptr().add(64 * $c));
                        let (r, s) = (&mut run[t], &mut sumi[t]);
                        // Running sums ≤ 8 · 4 · 31 · 127 per lane.
                        r[0] = sdot(r[0], lo[0], ya.0);
                        r[1] = sdot(r[1], lo[1], ya.1);
                        if $c == 0 {
                            s[0] = mul_lane::<0>(r[0], $d);
                            s[1] = mul_lane::<0>(r[1], $d);
                        } else {
                            s[0] = mla_lane::<$l0>(s[0], r[0], $d);
                            s[1] = mla_lane::<$l0>(s[1], r[1], $d);
                        }
                        r[0] = sdot(r[0], hi[0], ya.2);
                        r[1] = sdot(r[1], hi[1], ya.3);
                        s[0] = mla_lane::<$l1>(s[0], r[0], $d);
                        s[1] = mla_lane::<$l1>(s[1], r[1], $d);
                    }
                    hb = uint8x16x2_t(vshrq_n_u8::<2>(hb.0), vshrq_n_u8::<2>(hb.1));
                }};
            }
            chunk!(0, dlo, 0, 1);
            chunk!(1, dlo, 2, 3);
            chunk!(2, dhi, 0, 1);
            chunk!(3, dhi, 2, 3);
            // SAFETY: the block's first 4 bytes are d and dmin.
            let dx = super_scales_bits(u32::from_le(
                (x as *const BlockQ5K).cast::<u32>().read_unaligned(),
            ));
            for t in 0..N {
                let y = &a[t][i];
                // [d·d_a, dmin·d_a]: the scalar's `y.d * d` and `-y.d * dmin` (negation exact).
                let dd = vmulq_n_f32(dx, y.d);
                let summ = vaddvq_s32(mins_lanes(m16, y));
                m_sum[t] = (-vgetq_lane_f32::<1>(dd)).mul_add(summ as f32, m_sum[t]);
                for (l, s) in lanes[t].iter_mut().zip(sumi[t]) {
                    *l = vfmaq_laneq_f32::<0>(*l, vcvtq_f32_s32(s), dd);
                }
            }
        }
        std::array::from_fn(|t| reduce8(lanes[t][0], lanes[t][1]) + m_sum[t])
    }
}

/// One block of a row pair as [`pair`] takes it: `w[k]` = lane `k`'s weights, the 4 chunks'
/// `s1` products then their `s0` products; each vector is `[r0 L, r0 H, r1 L, r1 H]` with `L`
/// = values `4k .. 4k + 4` of sub-block `2c` times its scale part and `H` those of sub-block
/// `2c + 1`. `mins` = `[r0 m_0..m_7 | r1 m_0..m_7]`, `d` = `[d_0, d_0, d_1, d_1]` (the layout of
/// the lanes' results, `[r0·t0, r0·t1, r1·t0, r1·t1]`), `neg_dmin` = `[−dmin_0, −dmin_1,
/// −dmin_0, −dmin_1]` (that of the minimums' results, `[t0·r0, t0·r1, t1·r0, t1·r1]`).
#[derive(Copy, Clone)]
#[repr(C, align(16))]
struct RowPair {
    w: [[[u8; 16]; 8]; 8],
    mins: [i8; 16],
    d: [f32; 4],
    neg_dmin: [f32; 4],
}

impl Default for RowPair {
    fn default() -> Self {
        RowPair {
            w: [[[0; 16]; 8]; 8],
            mins: [0; 16],
            d: [0.0; 4],
            neg_dmin: [0.0; 4],
        }
    }
}

thread_local! {
    /// The token packings of this thread's recent calls (a product's row bands reuse them).
    static PAIRS: std::cell::RefCell<PackRing<Pairs>> = std::cell::RefCell::new(PackRing::default());
    /// The current row pair's blocks, built once for all token pairs.
    static ROWS: std::cell::RefCell<Vec<RowPair>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Token pairs a pass of [`pairs`] takes (each weight vector it loads serves both: the load
/// pipes bound one pair alone on Neoverse V1).
const PASS: usize = 2;

/// Token group `g = 4k + c` (lane `k`, chunk `c`): values `64c + 4k ..` of sub-block `2c` and
/// the same of sub-block `2c + 1`, the 8 the lane's weights of chunk `c` hold.
fn groups(g: usize) -> [usize; 2] {
    let (k, c) = (g / 4, g % 4);
    [64 * c + 4 * k, 64 * c + 32 + 4 * k]
}

/// Rows `rows` against `1 <= a.len() <= WIDE` tokens: two rows at a time (a last single row
/// is paired with itself), their blocks built once ([`build`]), then the token pairs by
/// [`PASS`] ([`pairs`]).
///
/// # Safety
/// The CPU has FEAT_I8MM and FEAT_DotProd; `rows` lie inside `w` (whole `row_bytes` rows),
/// each activation is prepared as Q8_K, `out[k]` has `rows.len()` entries per token.
#[target_feature(enable = "dotprod,i8mm")]
unsafe fn dot_wide(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &[&ActBuf],
    out: &mut [&mut [f32]],
) {
    let nb = row_bytes / std::mem::size_of::<BlockQ5K>();
    let nb = a.iter().fold(nb, |n, a| n.min(ActQ8K::view(a).len()));
    let n_pairs = a.len().min(WIDE).div_ceil(2);
    PAIRS.with(|cell| {
        ROWS.with(|rows_cell| {
            let ring = &mut *cell.borrow_mut();
            let pack = ring.get(|p| p.holds(a, nb), |p| p.fill(a, nb, groups));
            let built = &mut *rows_cell.borrow_mut();
            built.resize(nb, RowPair::default());
            let row =
                |r: usize| -> &[BlockQ5K] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
            by_row_steps::<2>(w, row_bytes, rows, out, |r, n| {
                let (r0, r1) = (row(r), row(if n == 2 { r + 1 } else { r }));
                // SAFETY: base Advanced SIMD; the blocks and `built` have nb entries.
                unsafe { build(r0, r1, built) };
                let mut v = [[0f32; WIDE]; 2];
                let mut p = 0;
                while p < n_pairs {
                    let mut res = [[0f32; 4]; PASS];
                    // SAFETY: i8mm and dotprod are present (the caller's); the pairs exist and
                    // `pack` and `built` hold nb blocks.
                    let k = unsafe {
                        if n_pairs - p >= PASS {
                            spill(&mut res, pairs::<PASS>(built, pack, p))
                        } else {
                            spill(&mut res, pairs::<1>(built, pack, p))
                        }
                    };
                    for (i, l) in res[..k].iter().enumerate() {
                        let t = 2 * (p + i);
                        [v[0][t], v[0][t + 1], v[1][t], v[1][t + 1]] = *l;
                    }
                    p += k;
                }
                v
            });
        });
    });
}

/// Builds rows `x0`, `x1` into `out` ([`RowPair`]): per chunk the two rows' 32 `qs` bytes
/// interleaved by 8 (`zip`), the fifth bits put in ([`chunk_values`]), `trn` of the low- and
/// high-nibble halves to the lanes' `[L, H]` words, then one `mul` by each scale part.
///
/// # Safety
/// Base Advanced SIMD; `x0`, `x1` and `out` have the same length.
#[inline]
unsafe fn build(x0: &[BlockQ5K], x1: &[BlockQ5K], out: &mut [RowPair]) {
    // SAFETY (every intrinsic and load): base Advanced SIMD; loads stay inside the blocks (16
    // head bytes, 32 of qh, 32 at 32c of qs), stores inside `out[b]`, the constant loads read
    // 16-byte arrays.
    unsafe {
        // Chunk c's scale bytes for [r0 L, r0 H, r1 L, r1 H] from [r0 sc_0..7 | r1 sc_0..7].
        const PICK: [[u8; 16]; 4] = {
            let mut p = [[0u8; 16]; 4];
            let mut c = 0;
            while c < 4 {
                let mut i = 0;
                while i < 16 {
                    p[c][i] = (8 * (i / 8) + 2 * c + (i / 4) % 2) as u8;
                    i += 1;
                }
                c += 1;
            }
            p
        };
        let seven = vdupq_n_u8(7);
        for ((x0, x1), o) in x0.iter().zip(x1).zip(out.iter_mut()) {
            let (h0, h1) = (head(x0), head(x1));
            let (s0, s1) = (
                vreinterpretq_u64_u8(scale_bytes(h0)),
                vreinterpretq_u64_u8(scale_bytes(h1)),
            );
            let sc = vreinterpretq_u8_u64(vzip1q_u64(s0, s1));
            vst1q_s8(
                o.mins.as_mut_ptr(),
                vreinterpretq_s8_u64(vzip2q_u64(s0, s1)),
            );
            let (part0, part1) = (vandq_u8(sc, seven), vshrq_n_u8::<3>(sc));
            let dd = vzip1q_f32(super_scales(h0), super_scales(h1)); // [d0, d1, dmin0, dmin1]
            vst1q_f32(o.d.as_mut_ptr(), vzip1q_f32(dd, dd));
            let m = vget_high_f32(dd);
            vst1q_f32(o.neg_dmin.as_mut_ptr(), vnegq_f32(vcombine_f32(m, m)));
            let zip = |a: uint8x16_t, b: uint8x16_t, high: bool| {
                let (a, b) = (vreinterpretq_u64_u8(a), vreinterpretq_u64_u8(b));
                vreinterpretq_u8_u64(if high {
                    vzip2q_u64(a, b)
                } else {
                    vzip1q_u64(a, b)
                })
            };
            // Both rows' qh bytes 16v + 8h .. + 8 (each vector: r0's 8, r1's 8), shifted
            // right by 2c in chunk c.
            let (q0, q1) = (vld1q_u8_x2(x0.qh.as_ptr()), vld1q_u8_x2(x1.qh.as_ptr()));
            let mut hb = [
                uint8x16x2_t(zip(q0.0, q1.0, false), zip(q0.0, q1.0, true)),
                uint8x16x2_t(zip(q0.1, q1.1, false), zip(q0.1, q1.1, true)),
            ];
            for c in 0..4 {
                let pick = vld1q_u8(PICK[c].as_ptr());
                let (sc0, sc1) = (vqtbl1q_u8(part0, pick), vqtbl1q_u8(part1, pick));
                let (r0, r1) = (
                    vld1q_u8_x2(x0.qs.as_ptr().add(32 * c)),
                    vld1q_u8_x2(x1.qs.as_ptr().add(32 * c)),
                );
                for v in 0..2 {
                    let (a, b) = if v == 0 { (r0.0, r1.0) } else { (r0.1, r1.1) };
                    let z = uint8x16x2_t(zip(a, b, false), zip(a, b, true));
                    let (lo, hi) = chunk_values(z, hb[v]);
                    for h in 0..2 {
                        let (lo, hi) = (vreinterpretq_u32_s8(lo[h]), vreinterpretq_u32_s8(hi[h]));
                        // Lanes 4v + 2h and 4v + 2h + 1.
                        let k = 4 * v + 2 * h;
                        for (k, lane) in [(k, vtrn1q_u32(lo, hi)), (k + 1, vtrn2q_u32(lo, hi))] {
                            let lane = vreinterpretq_u8_u32(lane);
                            // ≤ 31 · 7: one byte.
                            vst1q_u8(o.w[k][c].as_mut_ptr(), vmulq_u8(lane, sc1));
                            vst1q_u8(o.w[k][4 + c].as_mut_ptr(), vmulq_u8(lane, sc0));
                        }
                    }
                    hb[v] = uint8x16x2_t(vshrq_n_u8::<2>(hb[v].0), vshrq_n_u8::<2>(hb[v].1));
                }
            }
        }
    }
}

/// The built row pair `rows` against token pairs `first .. first + K` of `pack`: three passes
/// over the blocks, two with half the lanes each ([`half`]) and one for the minimums' chain
/// ([`minimums`]), so that the `K` pairs' accumulators and operands stay in registers; then
/// `reduce8(lanes) + m_sum`, each lane of a result `[r0·t0, r0·t1, r1·t0, r1·t1]` with the
/// bits of [`super::dot_scalar`].
///
/// # Safety
/// The CPU has FEAT_I8MM and FEAT_DotProd; pairs `first .. first + K` exist in `pack`, whose
/// block count is `rows.len()`.
#[target_feature(enable = "dotprod,i8mm")]
#[inline]
unsafe fn pairs<const K: usize>(rows: &[RowPair], pack: &Pairs, first: usize) -> [float32x4_t; K] {
    // SAFETY: the caller's.
    let (h0, h1, m) = unsafe {
        (
            half::<K, 0>(rows, pack, first),
            half::<K, 1>(rows, pack, first),
            minimums::<K>(rows, pack, first),
        )
    };
    std::array::from_fn(|p| {
        let ([a0, a1], [a2, a3], m) = (h0[p], h1[p], m[p]);
        // The reduce8 tree lane by lane, then m_sum from [t0·r0, t0·r1, t1·r0, t1·r1] to the
        // lanes' layout.
        let r = vaddq_f32(vaddq_f32(a0, a2), vaddq_f32(a1, a3));
        vaddq_f32(r, vzip1q_f32(m, vextq_f32::<2>(m, m)))
    })
}

/// The packing's pointers to pair `first + p`'s first block: values, pair sums' low and high
/// bytes, scales.
///
/// # Safety
/// Pair `first + p` exists in `pack`.
#[inline(always)]
unsafe fn pair_ptrs(
    pack: &Pairs,
    first: usize,
    p: usize,
) -> (*const i8, *const u8, *const i8, *const f32) {
    let at = (first + p) * pack.nb;
    // SAFETY: the caller's: the pair's nb blocks are inside each array.
    unsafe {
        (
            pack.qs.as_ptr().add(32 * at).cast(),
            pack.lo.as_ptr().add(at).cast(),
            pack.hi.as_ptr().add(at).cast(),
            pack.d.as_ptr().add(at).cast(),
        )
    }
}

/// Lanes `2H, 2H + 1, 2H + 4, 2H + 5` of [`pairs`]: per block and lane, 4 `usmmla` of the `s1`
/// weights, a shift by 3, 4 of the `s0` weights (the lane's exact sums for the 2 × 2 (row,
/// token)), one `fmla` by `d·d_a`. Returns per pair the reduce8 tree's first sums `l_2H +
/// l_2H+4` and `l_2H+1 + l_2H+5`.
///
/// # Safety
/// As [`pairs`].
#[target_feature(enable = "dotprod,i8mm")]
#[inline]
unsafe fn half<const K: usize, const H: usize>(
    rows: &[RowPair],
    pack: &Pairs,
    first: usize,
) -> [[float32x4_t; 2]; K] {
    let nb = pack.nb;
    // SAFETY (every intrinsic and load): the features are present (the caller's); every
    // pointer is inside the packing (pairs < first + K, blocks < nb) or `rows`.
    unsafe {
        let zero = vdupq_n_s32(0);
        let mut lanes = [[vdupq_n_f32(0.0); 4]; K];
        let ptrs: [_; K] = std::array::from_fn(|p| pair_ptrs(pack, first, p));
        for (b, x) in rows[..nb].iter().enumerate() {
            // [d_t0, d_t0, d_t1, d_t1] of each pair; the lanes' [d_r·d_t] in their layout.
            let xd = vld1q_f32(x.d.as_ptr());
            let d: [float32x4_t; K] = std::array::from_fn(|p| {
                let dt = vld1q_f32(ptrs[p].3.add(4 * b));
                vmulq_f32(xd, vuzp1q_f32(dt, dt))
            });
            let wp = x.w.as_ptr().cast::<u8>();
            macro_rules! lane {
                ($i:literal, $k:expr) => {{
                    let k = $k;
                    let w = |i: usize| vld1q_u8(wp.add(16 * (8 * k + i)));
                    let a: [[int8x16_t; 4]; K] = std::array::from_fn(|p| {
                        std::array::from_fn(|c| vld1q_s8(ptrs[p].0.add(512 * b + 16 * (4 * k + c))))
                    });
                    // 8 · Σ q·s1·a + Σ q·s0·a = Σ q·sc·a, ≤ 32 · 31 · 63 · 127 in magnitude.
                    let mut s = [zero; K];
                    for c in 0..4 {
                        let w = w(c);
                        for p in 0..K {
                            s[p] = usmmla(s[p], w, a[p][c]);
                        }
                    }
                    for p in 0..K {
                        s[p] = vshlq_n_s32::<3>(s[p]);
                    }
                    for c in 0..4 {
                        let w = w(4 + c);
                        for p in 0..K {
                            s[p] = usmmla(s[p], w, a[p][c]);
                        }
                    }
                    for p in 0..K {
                        lanes[p][$i] = vfmaq_f32(lanes[p][$i], vcvtq_f32_s32(s[p]), d[p]);
                    }
                }};
            }
            lane!(0, 2 * H);
            lane!(1, 2 * H + 1);
            lane!(2, 2 * H + 4);
            lane!(3, 2 * H + 5);
        }
        lanes.map(|[l0, l1, l4, l5]| [vaddq_f32(l0, l4), vaddq_f32(l1, l5)])
    }
}

/// The minimums' chain of [`pairs`]: per block Q4_K's `smmla` + `usmmla` of the pair sums'
/// bytes against the rows' minimums (`summ`, exact), one `fmla` by `−d_a·dmin`. Returns per
/// pair `m_sum` as `[t0·r0, t0·r1, t1·r0, t1·r1]`.
///
/// # Safety
/// As [`pairs`].
#[target_feature(enable = "dotprod,i8mm")]
#[inline]
unsafe fn minimums<const K: usize>(
    rows: &[RowPair],
    pack: &Pairs,
    first: usize,
) -> [float32x4_t; K] {
    let nb = pack.nb;
    // SAFETY (every intrinsic and load): as in [`half`].
    unsafe {
        let zero = vdupq_n_s32(0);
        let mut m_sum = [vdupq_n_f32(0.0); K];
        let ptrs: [_; K] = std::array::from_fn(|p| pair_ptrs(pack, first, p));
        for (b, x) in rows[..nb].iter().enumerate() {
            let mins = vld1q_s8(x.mins.as_ptr());
            let neg_dmin = vld1q_f32(x.neg_dmin.as_ptr());
            for (m, (_, lo, hi, dt)) in m_sum.iter_mut().zip(ptrs) {
                // Σ_j m_j · (lo_j + 256 · hi_j) = summ, exactly.
                let summ = usmmla(
                    vshlq_n_s32::<8>(smmla(zero, vld1q_s8(hi.add(16 * b)), mins)),
                    vld1q_u8(lo.add(16 * b)),
                    mins,
                );
                let dm = vmulq_f32(neg_dmin, vld1q_f32(dt.add(4 * b)));
                *m = vfmaq_f32(*m, vcvtq_f32_s32(summ), dm);
            }
        }
        m_sum
    }
}
