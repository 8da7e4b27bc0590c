//! Q5_K on aarch64: the NEON (`smull`) and dotprod (`sdot`) levels (i8mm runs dotprod's).
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

use super::super::format::{Dotprod, I8mm, Kernel, Neon};
use super::super::neon::{f16x4_to_f32, reduce8, sdot};
use super::super::q4_k::neon::{
    lane_diffs, mins_lanes, mla_lane, mul_lane, scale_bytes, scale_words, spread_bytes,
    super_scales_bits, vector_of,
};
use super::super::q8_k::BlockQ8K;
use super::{BlockQ5K, Q5K};
use std::arch::aarch64::*;

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
