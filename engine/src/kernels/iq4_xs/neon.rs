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
use super::super::neon::{f16x4_to_f32, reduce8, sdot, zeros_by_load};
use super::super::q8_k::BlockQ8K;
use super::{BlockIq4Xs, Iq4Xs};
use std::arch::aarch64::*;
use std::arch::asm;

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

/// Per block, decoded on the scalar pipes: `ls_i − ls_i+1` (`ls_8 = 0`) as four pairs of i32
/// lanes (sub-blocks `2j`, `2j + 1` in pair `j`), each moved over by one `fmov` into the low
/// half of a vector (the `mla` by element reads lane 0 or 1): no vector instruction, where
/// widening i16 lanes took two. The differences of the stored 6-bit `ls + 32` are those of
/// `ls`, and the last is `u_7 − 32`.
#[inline(always)]
fn coefficients(x: &BlockIq4Xs) -> [int32x2_t; 4] {
    // SAFETY: the block's first 8 bytes: d, scales_h, scales_l (one load).
    let head = u64::from_le(unsafe { (x as *const BlockIq4Xs).cast::<u64>().read_unaligned() });
    let l = head >> 32;
    let h = (head >> 16) & 0xffff;
    // `u_2j | u_2j+1 << 32`: the two nibbles of byte j of `l` and the bit pairs 4j .. 4j + 4
    // of `h` above them.
    let pair = |j: u32| {
        let n = (l >> (8 * j)) & 0xff;
        let g = (h >> (4 * j)) & 0xf;
        ((n | (n << 28)) & 0x0000_000f_0000_000f) | (((g | (g << 30)) & 0x0000_0003_0000_0003) << 4)
    };
    let u = [pair(0), pair(1), pair(2), pair(3), 32];
    const TOP: u64 = 0x8000_0000_8000_0000;
    std::array::from_fn(|j| {
        // [u_2j − u_2j+1, u_2j+1 − u_2j+2], the borrow between lanes blocked by bit 31.
        let next = (u[j] >> 32) | (u[j + 1] << 32);
        let d = ((u[j] | TOP) - next) ^ TOP;
        // SAFETY: base Advanced SIMD, register-only.
        unsafe { vcreate_s32(d) }
    })
}

/// `acc + a · b[L]` in each i32 lane, `b` a 64-bit vector (`mla` by element).
#[inline(always)]
fn mla_lane2<const L: i32>(mut acc: int32x4_t, a: int32x4_t, b: int32x2_t) -> int32x4_t {
    const { assert!(L >= 0 && L < 2) };
    // SAFETY: register-only base Advanced SIMD instruction.
    unsafe {
        asm!(
            "mla {acc:v}.4s, {a:v}.4s, {b:v}.s[{l}]",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            l = const L,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    acc
}

/// `a · b[L]` in each i32 lane, `b` a 64-bit vector (`mul` by element).
#[inline(always)]
fn mul_lane2<const L: i32>(a: int32x4_t, b: int32x2_t) -> int32x4_t {
    const { assert!(L >= 0 && L < 2) };
    let out: int32x4_t;
    // SAFETY: register-only base Advanced SIMD instruction.
    unsafe {
        asm!(
            "mul {o:v}.4s, {a:v}.4s, {b:v}.s[{l}]",
            o = lateout(vreg) out,
            a = in(vreg) a,
            b = in(vreg) b,
            l = const L,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    out
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

/// The f16 at `d` widened to f32, loaded straight into a vector register (`ldr h`) and
/// converted there (`fcvt`): two instructions, one of them on a vector pipe, where the word
/// moved over from a general register took a lane insert and a vector `fcvtl` (three).
/// Exact: the same bits as [`super::super::f16_to_f32`] (the conversion instruction's,
/// tested for all 65536 values in `neon.rs`).
#[inline(always)]
fn load_f16(d: &[u8; 2]) -> f32 {
    let out: f32;
    // SAFETY: reads the 2 bytes of `d` (`ldr h` of an unaligned address is allowed on
    // normal memory, as Linux maps it); base floating-point instructions.
    unsafe {
        asm!(
            "ldr {t:h}, [{p}]",
            "fcvt {o:s}, {t:h}",
            p = in(reg) d.as_ptr(),
            t = out(vreg) _,
            o = lateout(vreg) out,
            options(pure, readonly, nostack, preserves_flags)
        )
    };
    out
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
            let c = coefficients(x);
            // Fresh running sums from a load pipe (see `zeros_by_load`).
            let mut run: [[int32x4_t; 2]; N] =
                std::array::from_fn(|_| [zeros_by_load(), zeros_by_load()]);
            let mut sumi = [[zero; 2]; N];
            macro_rules! sub {
                ($i:literal, $l:literal) => {{
                    let q = vld1q_u8(x.qs.as_ptr().add(16 * $i));
                    let lo = vqtbl1q_s8(levels, vandq_u8(q, m4));
                    let hi = vqtbl1q_s8(levels, vshrq_n_u8::<4>(q));
                    let d = c[$i / 2];
                    for t in 0..N {
                        let ya = vld1q_s8_x2(a[t][i].qs.as_ptr().add(32 * $i));
                        let (r, s) = (&mut run[t], &mut sumi[t]);
                        // Running sums ≤ 8 · 4 · 127² per lane.
                        r[0] = sdot(r[0], lo, ya.0);
                        r[1] = sdot(r[1], hi, ya.1);
                        if $i == 0 {
                            s[0] = mul_lane2::<0>(r[0], d);
                            s[1] = mul_lane2::<0>(r[1], d);
                        } else {
                            s[0] = mla_lane2::<$l>(s[0], r[0], d);
                            s[1] = mla_lane2::<$l>(s[1], r[1], d);
                        }
                    }
                }};
            }
            sub!(0, 0);
            sub!(1, 1);
            sub!(2, 0);
            sub!(3, 1);
            sub!(4, 0);
            sub!(5, 1);
            sub!(6, 0);
            sub!(7, 1);
            let dx = load_f16(&x.d);
            for t in 0..N {
                // The scalar's `f16(d) · d_a`.
                let d = dx * a[t][i].d;
                for (l, s) in lanes[t].iter_mut().zip(sumi[t]) {
                    *l = vfmaq_n_f32(*l, vcvtq_f32_s32(s), d);
                }
            }
        }
        std::array::from_fn(|t| reduce8(lanes[t][0], lanes[t][1]))
    }
}
