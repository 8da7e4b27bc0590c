//! IQ4_XS on aarch64: the NEON (`smull`) and dotprod (`sdot`) levels (i8mm runs dotprod's).
//!
//! Why this exists: IQ4_XS is the 4.25-bit format of many large MoE releases. The indices
//! become IQ4_NL's levels by one `tbl` per 16 values; its order keeps 8 lane sums (values
//! `4k .. 4k + 4` of each sub-block in lane `k`), where `sdot` puts them (a sub-block's low
//! nibbles, its values 0–15, land in lanes 0–3, its high nibbles in lanes 4–7). As for Q5_K
//! (`q5_k/neon.rs`) each lane's `Σ_i ls_i · P_i` is summed by parts: one running `sdot` chain
//! per half and one `mla` by `ls_i − ls_i+1` per sub-block, the same exact integer. Then one
//! fused multiply-add per lane and super-block and [`reduce8`]: the bits of
//! [`super::dot_scalar`].

use super::super::format::{Dotprod, I8mm, Kernel, Neon};
use super::super::iq4_nl::LEVELS;
use super::super::neon::{f16x4_to_f32, reduce8, sdot};
use super::super::q4_k::neon::{lane_diffs, mla_lane, mul_lane, super_scales_bits, vector_of};
use super::super::q8_k::BlockQ8K;
use super::{BlockIq4Xs, Iq4Xs};
use std::arch::aarch64::*;

/// The first 8 bytes of block `x` (`d`, `scales_h`, `scales_l`).
///
/// # Safety
/// Base Advanced SIMD.
#[inline(always)]
unsafe fn head(x: &BlockIq4Xs) -> uint8x8_t {
    // SAFETY: the block is 136 bytes.
    unsafe { vld1_u8((x as *const BlockIq4Xs).cast()) }
}

/// The 8 sub-block scales `ls − 32` (−32..=31) as i16, from the head bytes `[d, d, h0, h1,
/// l0, l1, l2, l3]`: scale `i` is nibble `i % 2` of `l_{i/2}` and bits `2i % 8 ..` of
/// `h_{i/4}` above it.
///
/// # Safety
/// Base Advanced SIMD.
#[inline(always)]
unsafe fn scales(head: uint8x8_t) -> int16x8_t {
    // SAFETY (every intrinsic): base Advanced SIMD, register-only; 8-byte constant loads.
    unsafe {
        const LOW_IDX: [u8; 8] = [4, 4, 5, 5, 6, 6, 7, 7];
        const LOW_SHIFT: [i8; 8] = [0, -4, 0, -4, 0, -4, 0, -4];
        const HIGH_IDX: [u8; 8] = [2, 2, 2, 2, 3, 3, 3, 3];
        // Bits 2i .. 2i + 2 of the byte moved to bits 4–5.
        const HIGH_SHIFT: [i8; 8] = [4, 2, 0, -2, 4, 2, 0, -2];
        let low = vand_u8(
            vshl_u8(
                vtbl1_u8(head, vld1_u8(LOW_IDX.as_ptr())),
                vld1_s8(LOW_SHIFT.as_ptr()),
            ),
            vdup_n_u8(0x0F),
        );
        let high = vand_u8(
            vshl_u8(
                vtbl1_u8(head, vld1_u8(HIGH_IDX.as_ptr())),
                vld1_s8(HIGH_SHIFT.as_ptr()),
            ),
            vdup_n_u8(0x30),
        );
        vsubq_s16(
            vreinterpretq_s16_u16(vmovl_u8(vorr_u8(low, high))),
            vdupq_n_s16(32),
        )
    }
}

/// Per block, decoded on the scalar pipes: `ls_i − ls_i+1` (`ls_8 = 0`) as i32 lanes for
/// i = 0..3 and 4..7. The differences of the stored 6-bit `ls + 32` are those of `ls`, and
/// the last is `u_7 − 32`.
///
/// # Safety
/// Base Advanced SIMD.
#[inline(always)]
unsafe fn coefficients(x: &BlockIq4Xs) -> (int32x4_t, int32x4_t) {
    // 4 nibbles (16 bits) as the low bits of 4 u16 lanes.
    let nibbles = |n: u32| {
        let v = n as u64;
        let v = (v | (v << 24)) & 0x0000_00ff_0000_00ff;
        (v | (v << 12)) & 0x000f_000f_000f_000f
    };
    // 4 pairs of bits (8 bits) at bits 4–5 of 4 u16 lanes.
    let pairs = |g: u16| {
        let v = g as u64;
        let v = (v | (v << 28)) & 0x0000_000f_0000_000f;
        ((v | (v << 14)) & 0x0003_0003_0003_0003) << 4
    };
    // SAFETY: the block's first 8 bytes: d, scales_h, scales_l (one load).
    let head = u64::from_le(unsafe { (x as *const BlockIq4Xs).cast::<u64>().read_unaligned() });
    let l = (head >> 32) as u32;
    let h = (head >> 16) as u16;
    let u0 = nibbles(l & 0xffff) | pairs(h & 0xff);
    let u1 = nibbles(l >> 16) | pairs(h >> 8);
    let d = vector_of(lane_diffs(u0, u1), lane_diffs(u1, 32));
    // SAFETY: base Advanced SIMD, register-only.
    unsafe { (vmovl_s16(vget_low_s16(d)), vmovl_high_s16(d)) }
}

/// `d` of block `x` (lane 0; the other lanes are scale bits read as f16: never used).
#[inline(always)]
fn super_scale(head: uint8x8_t) -> float32x4_t {
    // SAFETY: base Advanced SIMD, register-only.
    f16x4_to_f32(unsafe { vreinterpret_u16_u8(head) })
}

impl Kernel<Iq4Xs> for Neon {
    unsafe fn dot(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
        // SAFETY: base Advanced SIMD (every aarch64 core).
        unsafe { dot_neon(w, a) }
    }
}

/// The NEON dot: per 16 values two `smull` (one product per i16 lane), `addp` to pair sums
/// (≤ 2 · 127², fits i16), two `smlal` by the scale into 8 i32 pair accumulators per half;
/// per block one `addp` folds the pairs into the 4 lanes of each half.
///
/// # Safety
/// Base Advanced SIMD.
unsafe fn dot_neon(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
    // SAFETY (every intrinsic): base Advanced SIMD; loads stay inside the blocks (16 bytes at
    // 16i of 128 qs, 32 at 32i of 256 activation bytes).
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        let levels = vld1q_s8(LEVELS.as_ptr());
        let mut lanes = [vdupq_n_f32(0.0); 2];
        for (x, y) in w.iter().zip(a) {
            let h = head(x);
            let ls = scales(h);
            let mut pairs = [vdupq_n_s32(0); 4];
            macro_rules! half {
                ($w:expr, $a:expr, $l:literal, $p:literal) => {{
                    let (w, a) = ($w, $a);
                    let pl = vmull_s8(vget_low_s8(w), vget_low_s8(a));
                    let ph = vmull_high_s8(w, a);
                    let pp = vpaddq_s16(pl, ph);
                    pairs[$p] = vmlal_laneq_s16::<$l>(pairs[$p], vget_low_s16(pp), ls);
                    pairs[$p + 1] = vmlal_high_laneq_s16::<$l>(pairs[$p + 1], pp, ls);
                }};
            }
            macro_rules! sub {
                ($i:literal) => {{
                    let q = vld1q_u8(x.qs.as_ptr().add(16 * $i));
                    let ya = vld1q_s8_x2(y.qs.as_ptr().add(32 * $i));
                    half!(vqtbl1q_s8(levels, vandq_u8(q, m4)), ya.0, $i, 0);
                    half!(vqtbl1q_s8(levels, vshrq_n_u8::<4>(q)), ya.1, $i, 2);
                }};
            }
            sub!(0);
            sub!(1);
            sub!(2);
            sub!(3);
            sub!(4);
            sub!(5);
            sub!(6);
            sub!(7);
            let sumi = [
                vpaddq_s32(pairs[0], pairs[1]),
                vpaddq_s32(pairs[2], pairs[3]),
            ];
            let d = vmulq_n_f32(super_scale(h), y.d);
            for (l, s) in lanes.iter_mut().zip(sumi) {
                *l = vfmaq_laneq_f32::<0>(*l, vcvtq_f32_s32(s), d);
            }
        }
        reduce8(lanes[0], lanes[1])
    }
}

impl Kernel<Iq4Xs> for Dotprod {
    unsafe fn dot(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (dotprod is present).
        let [v] = unsafe { dot_n::<1>(w, [a]) };
        v
    }

    /// Each block's levels looked up once for all the group's tokens.
    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockIq4Xs], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n::<N>(w, a) }
    }
}

impl Kernel<Iq4Xs> for I8mm {
    unsafe fn dot(w: &[BlockIq4Xs], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (the i8mm level includes dotprod).
        let [v] = unsafe { dot_n::<1>(w, [a]) };
        v
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockIq4Xs], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n::<N>(w, a) }
    }
}

/// One row against `N` tokens (`1 <= N <= 4`): per block the scales and their differences
/// and the 16 level vectors built once; per token two running `sdot` chains (lanes 0–3, 4–7)
/// and after each sub-block two `mla` by `ls_i − ls_i+1` (`ls_8 = 0`).
///
/// # Safety
/// The CPU has FEAT_DotProd.
#[target_feature(enable = "dotprod")]
#[inline]
unsafe fn dot_n<const N: usize>(w: &[BlockIq4Xs], a: [&[BlockQ8K]; N]) -> [f32; N] {
    let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
    // SAFETY (every intrinsic and load): dotprod is present (the caller's); loads stay inside
    // the blocks (16 bytes at 16i of 128 qs, 32 bytes at 32i of 256 activation bytes).
    unsafe {
        let zero = vdupq_n_s32(0);
        let m4 = vdupq_n_u8(0x0F);
        let levels = vld1q_s8(LEVELS.as_ptr());
        let mut lanes = [[vdupq_n_f32(0.0); 2]; N];
        for (i, x) in w[..n].iter().enumerate() {
            let (dlo, dhi) = coefficients(x);
            let mut run = [[zero; 2]; N];
            let mut sumi = [[zero; 2]; N];
            macro_rules! sub {
                ($i:literal, $d:ident, $l:literal) => {{
                    let q = vld1q_u8(x.qs.as_ptr().add(16 * $i));
                    let lo = vqtbl1q_s8(levels, vandq_u8(q, m4));
                    let hi = vqtbl1q_s8(levels, vshrq_n_u8::<4>(q));
                    for t in 0..N {
                        let ya = vld1q_s8_x2(a[t][i].qs.as_ptr().add(32 * $i));
                        let (r, s) = (&mut run[t], &mut sumi[t]);
                        // Running sums ≤ 8 · 4 · 127² per lane.
                        r[0] = sdot(r[0], lo, ya.0);
                        r[1] = sdot(r[1], hi, ya.1);
                        if $i == 0 {
                            s[0] = mul_lane::<0>(r[0], $d);
                            s[1] = mul_lane::<0>(r[1], $d);
                        } else {
                            s[0] = mla_lane::<$l>(s[0], r[0], $d);
                            s[1] = mla_lane::<$l>(s[1], r[1], $d);
                        }
                    }
                }};
            }
            sub!(0, dlo, 0);
            sub!(1, dlo, 1);
            sub!(2, dlo, 2);
            sub!(3, dlo, 3);
            sub!(4, dhi, 0);
            sub!(5, dhi, 1);
            sub!(6, dhi, 2);
            sub!(7, dhi, 3);
            // From the scalar registers (a vector load of the head would overlap the scale
            // bytes the scalar pipes decode).
            let dx = super_scales_bits(u16::from_le_bytes(x.d) as u32);
            for t in 0..N {
                // The scalar's `f16(d) · d_a`.
                let d = vmulq_n_f32(dx, a[t][i].d);
                for (l, s) in lanes[t].iter_mut().zip(sumi[t]) {
                    *l = vfmaq_laneq_f32::<0>(*l, vcvtq_f32_s32(s), d);
                }
            }
        }
        std::array::from_fn(|t| reduce8(lanes[t][0], lanes[t][1]))
    }
}
