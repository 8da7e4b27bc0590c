//! aarch64 kernels of the [`Block32`] formats (Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4): the scalar
//! reference's 8 lanes of exact 4-value sums and its float steps, written once for every
//! format, with each format's [`Block32::levels_neon`] turning a block into its 32 levels.
//!
//! Why this shape: a block's 32 products summed in 8 lanes of 4 consecutive values is exactly
//! what `sdot` leaves (16 bytes → 4 lanes), and what `smull` + `addp` + `sadalp` leave without
//! FEAT_DotProd, so both levels share one loop ([`LaneDot`] is the only difference).
//!
//! The lane sums are never converted with `scvtf` (two µops on one pipe of Neoverse N2 and
//! V1): each block half's `sdot` accumulates into a fresh register holding `MAGIC` = 1.5 · 2^23
//! in every lane, whose bits read as a float are then exactly `MAGIC + sum` (|sum| < 2^22), so
//! one `fsub` of `MAGIC` converts the four lane sums. The fresh register is a load (a load-pipe
//! µop; a copy of a kept register would be a vector µop, and the vector pipes are what these
//! loops are bound by), and the load, `sdot`, `fsub` and the scalar's fused step
//! (`lane = fma(d_w·d_a, sum, lane)` per block, [`Order`]) are one piece of assembly, so the
//! compiler cannot hoist the products away from their float steps and spill the results
//! between them. No bit changes: the float steps are the scalar's.
//!
//! Per block, row and token that is 6 vector instructions (2 `sdot`, 2 `fsub`, 2 `fmla` for
//! the 8 lanes), which the scalar order fixes; the weights' unpacking is shared by the tokens
//! of a group, the activations' loads by the rows. Scales come four blocks at a time: the
//! activation's as f32 from [`Q8Act`] (one load), the weights' gathered through a general
//! register and converted by one `fcvtl`.
//!
//! Prefill: from 5 tokens on, [`wide_dotprod`] unpacks each row once into a per-thread
//! buffer (levels, scales, offsets) and runs the tokens over it in groups of 4; below that
//! [`dot_group`] unpacks each weight block once for up to 4 tokens; decode:
//! [`dot_rows`] runs 2 rows at once (4 for the offset formats, whose offset chains then fill
//! a vector: one `fmla` by element per block for all 4 rows).

use super::super::format::{prefetch_lines, PREFETCH_AHEAD};
use super::super::neon as arm;
use super::super::q8_0::{BlockQ8_0, Q8Act};
use super::super::{blocks, ActBuf};
use super::{Block32, Order, Scale};
use std::arch::aarch64::*;
use std::ops::Range;

/// 1.5 · 2^23 as f32 bits: the lane sums' start (see the module header).
const MAGIC: i32 = 0x4B40_0000;
/// [`MAGIC`] in every lane, in memory: [`magic_fresh`] loads it.
static MAGIC4: [i32; 4] = [MAGIC; 4];

/// A fresh register holding [`MAGIC`] in every lane, for one `sdot` to accumulate into.
///
/// Why a load: `sdot` overwrites its accumulator, so a block's sums started from a register
/// kept for the purpose (or run on from the previous block's, which the subtraction still
/// needs) cost a vector `mov` each — a µop on the vector pipes, the bottleneck here. A load
/// is a µop on the load pipes, which have room. Written as assembly that is not `pure`, so
/// that the compiler keeps one load per use instead of hoisting one out of the loop and
/// copying it.
#[inline(always)]
fn magic_fresh() -> int32x4_t {
    let out: int32x4_t;
    // SAFETY: a 16-byte load from a static of 16 bytes; no other effect.
    unsafe {
        std::arch::asm!(
            "ldr {o:q}, [{p}]",
            p = in(reg) MAGIC4.as_ptr(),
            o = lateout(vreg) out,
            options(nostack, readonly, preserves_flags)
        )
    };
    out
}

/// One instruction set's 4-value dot: `acc[i] + Σ_{k<4} w[4i + k] · a[4i + k]` in each i32
/// lane, exactly (products of levels within ±127 and activations within ±127).
pub(crate) trait LaneDot {
    /// # Safety
    /// The CPU has what the implementation needs.
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t;

    /// One block half's float step: `acc + d[K] · s`, fused, with `s` the exact lane sums of
    /// `w · a` (started from a fresh [`MAGIC`], converted by subtracting `magic`).
    ///
    /// # Safety
    /// As [`LaneDot::dot`].
    #[inline(always)]
    unsafe fn fma_sums<const K: i32>(
        acc: float32x4_t,
        w: int8x16_t,
        a: int8x16_t,
        magic: float32x4_t,
        d: float32x4_t,
    ) -> float32x4_t {
        // SAFETY: the caller's; register-only.
        unsafe {
            let s = Self::dot(magic_fresh(), w, a);
            fma_lane::<K>(acc, vsubq_f32(vreinterpretq_f32_s32(s), magic), d)
        }
    }

    /// `[*c, 0, 0, 0]` plus the 4-lane dot of a whole block, `w[h] · a[h]` for both halves:
    /// the start loaded into a fresh register (as [`magic_fresh`], for the same reason), so
    /// the lanes' total is `*c` plus the block's exact sum.
    ///
    /// # Safety
    /// As [`LaneDot::dot`]; `c` points at an i32.
    #[inline(always)]
    unsafe fn dot32_from(c: *const i32, w: [int8x16_t; 2], a: [int8x16_t; 2]) -> int32x4_t {
        let s: int32x4_t;
        // SAFETY: a 4-byte load from the caller's pointer (`ldr s` zeroes the other lanes).
        unsafe {
            std::arch::asm!(
                "ldr {s:s}, [{c}]",
                c = in(reg) c,
                s = lateout(vreg) s,
                options(nostack, readonly, preserves_flags)
            );
            Self::dot(Self::dot(s, w[0], a[0]), w[1], a[1])
        }
    }
}

/// FEAT_DotProd's `sdot`.
pub(crate) struct Sdot;
impl LaneDot for Sdot {
    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
        // SAFETY: the caller's (dotprod is present).
        unsafe { arm::sdot(acc, w, a) }
    }

    #[inline(always)]
    unsafe fn fma_sums<const K: i32>(
        acc: float32x4_t,
        w: int8x16_t,
        a: int8x16_t,
        magic: float32x4_t,
        d: float32x4_t,
    ) -> float32x4_t {
        // SAFETY: the caller's (dotprod is present).
        unsafe { sdot_fma::<K>(acc, w, a, magic, d) }
    }

    #[inline(always)]
    unsafe fn dot32_from(c: *const i32, w: [int8x16_t; 2], a: [int8x16_t; 2]) -> int32x4_t {
        // SAFETY: the caller's (dotprod is present, `c` points at an i32).
        unsafe { sdot32_from(c, w, a) }
    }
}

/// [`LaneDot::dot32_from`] with `sdot`: the load and both `sdot`s as one piece of assembly.
#[inline]
#[target_feature(enable = "dotprod")]
unsafe fn sdot32_from(c: *const i32, w: [int8x16_t; 2], a: [int8x16_t; 2]) -> int32x4_t {
    let s: int32x4_t;
    // SAFETY: a 4-byte load from the caller's pointer, then register-only instructions of a
    // feature this function requires.
    unsafe {
        std::arch::asm!(
            "ldr {s:s}, [{c}]",
            "sdot {s:v}.4s, {w0:v}.16b, {a0:v}.16b",
            "sdot {s:v}.4s, {w1:v}.16b, {a1:v}.16b",
            c = in(reg) c,
            s = out(vreg) s,
            w0 = in(vreg) w[0],
            a0 = in(vreg) a[0],
            w1 = in(vreg) w[1],
            a1 = in(vreg) a[1],
            options(nostack, readonly, preserves_flags)
        )
    };
    s
}

/// [`LaneDot::fma_sums`] with `sdot`, as one piece of assembly: load `MAGIC`, `sdot` into it,
/// subtract `magic`, `fmla` by element. Why: given the four as separate operations, the
/// compiler's scheduler hoists every `sdot` of a step ahead of the float steps, and the
/// results it holds then spill (stores are vector µops on Neoverse N2); the core reorders
/// them anyway.
#[inline]
#[target_feature(enable = "dotprod")]
unsafe fn sdot_fma<const K: i32>(
    mut acc: float32x4_t,
    w: int8x16_t,
    a: int8x16_t,
    magic: float32x4_t,
    d: float32x4_t,
) -> float32x4_t {
    const { assert!(K >= 0 && K < 4) };
    // SAFETY: a 16-byte load from a static of 16 bytes, then register-only instructions of a
    // feature this function requires.
    unsafe {
        std::arch::asm!(
            "ldr {s:q}, [{p}]",
            "sdot {s:v}.4s, {w:v}.16b, {a:v}.16b",
            "fsub {s:v}.4s, {s:v}.4s, {magic:v}.4s",
            "fmla {acc:v}.4s, {s:v}.4s, {d:v}.s[{k}]",
            p = in(reg) MAGIC4.as_ptr(),
            s = out(vreg) _,
            w = in(vreg) w,
            a = in(vreg) a,
            magic = in(vreg) magic,
            d = in(vreg) d,
            acc = inout(vreg) acc,
            k = const K,
            options(nostack, readonly, preserves_flags)
        )
    };
    acc
}

/// Base Advanced SIMD: 16-bit products, pairs added (|pair| ≤ 2 · 127 · 127 < 2^15, exact),
/// then pairs of pairs added into the i32 lanes.
pub(crate) struct Widen;
impl LaneDot for Widen {
    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
        // SAFETY: base Advanced SIMD, register-only.
        unsafe {
            let lo = vmull_s8(vget_low_s8(w), vget_low_s8(a));
            let hi = vmull_high_s8(w, a);
            vpadalq_s16(acc, vpaddq_s16(lo, hi))
        }
    }
}

/// A 64-bit word into the low half of a vector register (`fmov d, x`), written as assembly so
/// that the compiler keeps a gather of small fields in general registers (it otherwise turns
/// one into lane inserts, a vector µop each).
#[inline(always)]
pub(crate) fn u64_to_vec(bits: u64) -> uint64x1_t {
    let out: uint64x1_t;
    // SAFETY: register-only base floating-point move.
    unsafe {
        std::arch::asm!(
            "fmov {o:d}, {x}",
            o = lateout(vreg) out,
            x = in(reg) bits,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    out
}

/// Four f16 scales (little-endian bits) as f32: one `fcvtl`, the bits gathered through a
/// general register.
#[inline(always)]
pub(crate) fn f16x4(h: [[u8; 2]; 4]) -> float32x4_t {
    let bits = h.iter().enumerate().fold(0u64, |v, (k, h)| {
        v | (u16::from_le_bytes(*h) as u64) << (16 * k)
    });
    // SAFETY: base Advanced SIMD, register-only.
    arm::f16x4_to_f32(unsafe { vreinterpret_u16_u64(u64_to_vec(bits)) })
}

/// A block's scale, exactly [`Block32::scale`] (the conversion instruction for f16, a table
/// for MXFP4's powers of two).
#[inline(always)]
fn scale1<B: Block32>(x: &B) -> f32 {
    match x.scale_raw() {
        Scale::F16(h) => arm::f16_to_f32(h),
        Scale::E8m0Half(e) => f32::from_bits(super::super::mxfp4::E8M0_HALF_BITS[e as usize]),
    }
}

/// Four blocks' scales, lane `k` = [`scale1`] of `x[k]`.
#[inline(always)]
fn scale4<B: Block32>(x: [&B; 4]) -> float32x4_t {
    match x[0].scale_raw() {
        Scale::F16(_) => f16x4(x.map(|b| match b.scale_raw() {
            Scale::F16(h) => h,
            Scale::E8m0Half(_) => [0; 2],
        })),
        Scale::E8m0Half(_) => {
            let bits = x.map(|b| match b.scale_raw() {
                Scale::E8m0Half(e) => super::super::mxfp4::E8M0_HALF_BITS[e as usize] as u64,
                Scale::F16(_) => 0,
            });
            // SAFETY: base Advanced SIMD, register-only.
            unsafe {
                vreinterpretq_f32_u64(vcombine_u64(
                    u64_to_vec(bits[0] | bits[1] << 32),
                    u64_to_vec(bits[2] | bits[3] << 32),
                ))
            }
        }
    }
}

/// The 16 activation bytes of lanes 0–3 and of lanes 4–7 of a block.
#[inline(always)]
unsafe fn act(y: &BlockQ8_0) -> [int8x16_t; 2] {
    let p = y.qs.as_ptr();
    // SAFETY: 32 bytes of qs.
    unsafe { [vld1q_s8(p), vld1q_s8(p.add(16))] }
}

/// `acc + f · d[K]`, fused (the scalar's `d.mul_add(sum, lane)`).
#[inline(always)]
fn fma_lane<const K: i32>(acc: float32x4_t, f: float32x4_t, d: float32x4_t) -> float32x4_t {
    // SAFETY: base Advanced SIMD, register-only.
    unsafe { vfmaq_laneq_f32::<K>(acc, f, d) }
}

/// Where [`core`] reads a row from: its blocks, or the row unpacked once for many tokens
/// ([`Unpacked`]).
trait RowSrc<B: Block32>: Copy {
    /// Blocks in the row.
    fn len(&self) -> usize;
    /// Block `i`'s levels (`i < len`).
    unsafe fn levels(&self, i: usize) -> [int8x16_t; 2];
    /// Block `i`'s scale, [`scale1`].
    unsafe fn scale1(&self, i: usize) -> f32;
    /// Blocks `i .. i + 4`'s scales, [`scale4`].
    unsafe fn scale4(&self, i: usize) -> float32x4_t;
    /// Block `i`'s offset, f16 bits.
    unsafe fn offset_raw(&self, i: usize) -> [u8; 2];
    /// Blocks `i .. i + 4`'s offsets as f32.
    unsafe fn offset4(&self, i: usize) -> float32x4_t;
}

impl<B: Block32> RowSrc<B> for &[B] {
    #[inline(always)]
    fn len(&self) -> usize {
        <[B]>::len(self)
    }
    #[inline(always)]
    unsafe fn levels(&self, i: usize) -> [int8x16_t; 2] {
        // SAFETY: the caller's (`i < len`).
        unsafe { self.get_unchecked(i) }.levels_neon()
    }
    #[inline(always)]
    unsafe fn scale1(&self, i: usize) -> f32 {
        // SAFETY: the caller's.
        scale1(unsafe { self.get_unchecked(i) })
    }
    #[inline(always)]
    unsafe fn scale4(&self, i: usize) -> float32x4_t {
        // SAFETY: the caller's (`i + 4 <= len`).
        scale4(std::array::from_fn(|k| unsafe {
            self.get_unchecked(i + k)
        }))
    }
    #[inline(always)]
    unsafe fn offset_raw(&self, i: usize) -> [u8; 2] {
        // SAFETY: the caller's.
        unsafe { self.get_unchecked(i) }.offset_raw()
    }
    #[inline(always)]
    unsafe fn offset4(&self, i: usize) -> float32x4_t {
        // SAFETY: the caller's.
        f16x4(std::array::from_fn(|k| {
            unsafe { self.get_unchecked(i + k) }.offset_raw()
        }))
    }
}

/// A row unpacked by [`unpack`]: each block's 32 levels, scale and offset (as f32 and as its
/// f16 bits), so the tokens' passes over the row load them instead of decoding the blocks
/// again.
#[derive(Copy, Clone)]
struct Unpacked<'a> {
    q: &'a [[i8; 32]],
    d: &'a [f32],
    m: &'a [f32],
    m_raw: &'a [[u8; 2]],
}

impl<B: Block32> RowSrc<B> for Unpacked<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.q.len()
    }
    #[inline(always)]
    unsafe fn levels(&self, i: usize) -> [int8x16_t; 2] {
        // SAFETY: the caller's (`i < len`): 32 bytes.
        unsafe {
            let p = self.q.get_unchecked(i).as_ptr();
            [vld1q_s8(p), vld1q_s8(p.add(16))]
        }
    }
    #[inline(always)]
    unsafe fn scale1(&self, i: usize) -> f32 {
        // SAFETY: the caller's.
        unsafe { *self.d.get_unchecked(i) }
    }
    #[inline(always)]
    unsafe fn scale4(&self, i: usize) -> float32x4_t {
        // SAFETY: the caller's (`i + 4 <= len`).
        unsafe { vld1q_f32(self.d.as_ptr().add(i)) }
    }
    #[inline(always)]
    unsafe fn offset_raw(&self, i: usize) -> [u8; 2] {
        // SAFETY: the caller's.
        unsafe { *self.m_raw.get_unchecked(i) }
    }
    #[inline(always)]
    unsafe fn offset4(&self, i: usize) -> float32x4_t {
        // SAFETY: the caller's.
        unsafe { vld1q_f32(self.m.as_ptr().add(i)) }
    }
}

/// The dot products of `R` rows with `T` activations, `out[r][t]`, each with the bits of
/// [`super::dot_scalar`] (see the module header). One of `R`, `T` is 1, the other at most 4.
///
/// The offset chains of [`Order::LanesOffset`] (`m_sum = fma(m_w, s_a, m_sum)` per block)
/// run side by side in the lanes of one vector, lane `r` (one token) or `t` (one row): per
/// block one `fmla` by element with the four rows' `m` (or four tokens' `s`) gathered and
/// converted by one `fcvtl`, against the other side's four blocks converted once.
#[inline(always)]
unsafe fn core<B: Block32, D: LaneDot, S: RowSrc<B>, const R: usize, const T: usize>(
    w: [S; R],
    a: [&Q8Act; T],
) -> [[f32; T]; R] {
    const { assert!((R == 1 || T == 1) && R <= 4 && T <= 4) };
    let offset = const { matches!(B::ORDER, Order::LanesOffset) };
    // The scalar's zips: the offset formats also stop at the activation's `s` terms.
    let n = w
        .iter()
        .map(|r| r.len())
        .chain(a.iter().map(|a| a.blocks.len().min(a.d.len())))
        .chain(a.iter().filter(|_| offset).map(|a| a.s.len()))
        .min()
        .unwrap_or(0);
    // Unchecked access below: every block index is below `n` (the loops' bounds).
    let ap = a.map(|a| a.blocks.as_ptr());
    let (dp, sp) = (a.map(|a| a.d.as_ptr()), a.map(|a| a.s.as_ptr()));
    // SAFETY (all): `i < n`, inside every row and activation.
    let y = |t: usize, i: usize| -> &BlockQ8_0 { unsafe { &*ap[t].add(i) } };
    let s_of = |t: usize, i: usize| -> [u8; 2] { unsafe { *sp[t].add(i) } };
    let pairs = const { matches!(B::ORDER, Order::Pairs) };
    let in_lanes = if pairs { n / 2 * 2 } else { n };
    // The offset terms of block `i` across the rows (one token) or the tokens (one row), and
    // of four blocks from `i` on the other side.
    let m_across = |i: usize| -> float32x4_t {
        if T == 1 {
            f16x4(std::array::from_fn(|r| unsafe {
                w[r.min(R - 1)].offset_raw(i)
            }))
        } else {
            f16x4(std::array::from_fn(|t| s_of(t.min(T - 1), i)))
        }
    };
    let m_four = |i: usize| -> float32x4_t {
        if T == 1 {
            f16x4(std::array::from_fn(|k| s_of(0, i + k)))
        } else {
            unsafe { w[0].offset4(i) }
        }
    };
    // SAFETY (the whole body): the caller's (the level of `D`); register-only intrinsics and
    // loads of blocks below `n`.
    unsafe {
        let zero = vdupq_n_f32(0.0);
        let magic = vreinterpretq_f32_s32(vdupq_n_s32(MAGIC));
        // acc[r][t]: lanes 0–3 and 4–7; `odd` the odd blocks' of the Pairs order (two arrays,
        // not one indexed by the block's parity: the compiler then keeps them in registers).
        let mut acc = [[[zero; 2]; T]; R];
        let mut odd = [[[zero; 2]; T]; R];
        // The offset chains: lane r (T == 1) or t (R == 1).
        let mut m_sum = zero;
        let mut b = 0;
        // Four blocks a step: their scales converted four at a time.
        while b + 4 <= in_lanes {
            let da: [float32x4_t; T] = std::array::from_fn(|t| vld1q_f32(dp[t].add(b)));
            let mut d = [[zero; T]; R];
            for (r, d) in d.iter_mut().enumerate() {
                let dw = w[r].scale4(b);
                for t in 0..T {
                    d[t] = vmulq_f32(dw, da[t]);
                }
            }
            let m4 = if offset { m_four(b) } else { zero };
            macro_rules! step {
                ($k:literal, $acc:ident) => {{
                    let i = b + $k;
                    let q: [[int8x16_t; 2]; R] = std::array::from_fn(|r| w[r].levels(i));
                    // Each token's activation loaded where it is used (loaded all at once
                    // they would take the registers the accumulators need).
                    for t in 0..T {
                        let ya = act(y(t, i));
                        for r in 0..R {
                            let l = &mut $acc[r][t];
                            for h in 0..2 {
                                l[h] = D::fma_sums::<$k>(l[h], q[r][h], ya[h], magic, d[r][t]);
                            }
                        }
                    }
                    if offset {
                        m_sum = fma_lane::<$k>(m_sum, m_across(i), m4);
                    }
                }};
            }
            step!(0, acc);
            if pairs {
                step!(1, odd);
                step!(2, acc);
                step!(3, odd);
            } else {
                step!(1, acc);
                step!(2, acc);
                step!(3, acc);
            }
            b += 4;
        }
        while b < in_lanes {
            let set = if pairs && b % 2 == 1 {
                &mut odd
            } else {
                &mut acc
            };
            for r in 0..R {
                let q = w[r].levels(b);
                let dw = w[r].scale1(b);
                for t in 0..T {
                    let d = vdupq_n_f32(dw * *dp[t].add(b));
                    let ya = act(y(t, b));
                    let l = &mut set[r][t];
                    for h in 0..2 {
                        l[h] = D::fma_sums::<0>(l[h], q[h], ya[h], magic, d);
                    }
                }
            }
            if offset {
                let other = if T == 1 {
                    arm::f16_to_f32(s_of(0, b))
                } else {
                    arm::f16_to_f32(w[0].offset_raw(b))
                };
                m_sum = vfmaq_f32(m_sum, m_across(b), vdupq_n_f32(other));
            }
            b += 1;
        }
        let mut m_lanes = [0f32; 4];
        vst1q_f32(m_lanes.as_mut_ptr(), m_sum);
        let mut out = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                let l = if pairs {
                    [
                        vaddq_f32(acc[r][t][0], odd[r][t][0]),
                        vaddq_f32(acc[r][t][1], odd[r][t][1]),
                    ]
                } else {
                    acc[r][t]
                };
                let mut v = arm::reduce8(l[0], l[1]);
                if offset {
                    v += m_lanes[r + t];
                }
                if pairs && n % 2 == 1 {
                    // The unpaired last block, fused in whole.
                    let yb = y(t, n - 1);
                    let q = w[r].levels(n - 1);
                    let ya = act(yb);
                    let s = D::dot(D::dot(vdupq_n_s32(0), q[0], ya[0]), q[1], ya[1]);
                    let d = w[r].scale1(n - 1) * *dp[t].add(n - 1);
                    v = d.mul_add(vaddvq_s32(s) as f32, v);
                }
                out[r][t] = v;
            }
        }
        out
    }
}

/// Rows `rows` of a matrix of `row_bytes`-byte rows, `STEP` at a time, then halving (`out`
/// as [`super::super::format::Kernel::dot_rows`]): 4 for the offset formats (their chains
/// fill a vector), else 2 (as fast, and the Pairs order's 16 accumulators of 4 rows would
/// not leave registers for the rest).
#[inline(always)]
unsafe fn rows_core<B: Block32, D: LaneDot>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    let row = |r: usize| -> &[B] { blocks(&w[r * row_bytes..(r + 1) * row_bytes]) };
    let step = const {
        if matches!(B::ORDER, Order::LanesOffset) {
            4
        } else {
            2
        }
    };
    let first = rows.start;
    let mut r = rows.start;
    while r < rows.end {
        let mut n = step;
        while n > rows.end - r {
            n /= 2;
        }
        prefetch_lines(w, r * row_bytes + PREFETCH_AHEAD, n * row_bytes);
        // SAFETY (every arm): the caller's (the level of `D`).
        unsafe {
            match n {
                4 => {
                    let v =
                        core::<B, D, &[B], 4, 1>([row(r), row(r + 1), row(r + 2), row(r + 3)], [a]);
                    for k in 0..4 {
                        out[r + k - first] = v[k][0];
                    }
                }
                2 => {
                    let v = core::<B, D, &[B], 2, 1>([row(r), row(r + 1)], [a]);
                    out[r - first] = v[0][0];
                    out[r + 1 - first] = v[1][0];
                }
                _ => out[r - first] = core::<B, D, &[B], 1, 1>([row(r)], [a])[0][0],
            }
        }
        r += n;
    }
}

/// One row against `N` activations (`N ≤ 4`).
#[inline(always)]
unsafe fn group_core<B: Block32, D: LaneDot, const N: usize>(w: &[B], a: [&Q8Act; N]) -> [f32; N] {
    // SAFETY: the caller's.
    unsafe { core::<B, D, &[B], 1, N>([w], a)[0] }
}

/// [`super::dot_scalar`] with base Advanced SIMD.
///
/// # Safety
/// None beyond aarch64 (every aarch64 core has Advanced SIMD).
pub(crate) unsafe fn dot_neon<B: Block32>(w: &[B], a: &Q8Act) -> f32 {
    // SAFETY: base Advanced SIMD.
    unsafe { core::<B, Widen, &[B], 1, 1>([w], [a])[0][0] }
}

/// [`Kernel::dot_rows`](super::super::format::Kernel::dot_rows) with base Advanced SIMD.
///
/// # Safety
/// As [`dot_neon`]; `rows` lie inside `w`, `out.len() == rows.len()`.
pub(crate) unsafe fn rows_neon<B: Block32>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    // SAFETY: the caller's.
    unsafe { rows_core::<B, Widen>(w, row_bytes, rows, a, out) }
}

/// [`Kernel::dot_group`](super::super::format::Kernel::dot_group) with base Advanced SIMD.
///
/// # Safety
/// As [`dot_neon`].
pub(crate) unsafe fn group_neon<B: Block32, const N: usize>(w: &[B], a: [&Q8Act; N]) -> [f32; N] {
    // SAFETY: the caller's.
    unsafe { group_core::<B, Widen, N>(w, a) }
}

/// [`super::dot_scalar`] with `sdot`.
///
/// # Safety
/// The CPU has FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub(crate) unsafe fn dot_dotprod<B: Block32>(w: &[B], a: &Q8Act) -> f32 {
    // SAFETY: dotprod is present (this function's contract).
    unsafe { core::<B, Sdot, &[B], 1, 1>([w], [a])[0][0] }
}

/// [`rows_neon`] with `sdot`.
///
/// # Safety
/// As [`dot_dotprod`]; `rows` lie inside `w`, `out.len() == rows.len()`.
#[target_feature(enable = "dotprod")]
pub(crate) unsafe fn rows_dotprod<B: Block32>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    // SAFETY: the caller's.
    unsafe { rows_core::<B, Sdot>(w, row_bytes, rows, a, out) }
}

/// [`group_neon`] with `sdot`.
///
/// # Safety
/// As [`dot_dotprod`].
#[target_feature(enable = "dotprod")]
pub(crate) unsafe fn group_dotprod<B: Block32, const N: usize>(
    w: &[B],
    a: [&Q8Act; N],
) -> [f32; N] {
    // SAFETY: the caller's.
    unsafe { group_core::<B, Sdot, N>(w, a) }
}

/// A row's blocks unpacked for [`Unpacked`]; kept per thread and reused (its vectors grow to
/// the longest row and stay).
#[derive(Default)]
struct UnpackBuf {
    q: Vec<[i8; 32]>,
    d: Vec<f32>,
    m: Vec<f32>,
    m_raw: Vec<[u8; 2]>,
}

thread_local! {
    static UNPACKED: std::cell::RefCell<UnpackBuf> = std::cell::RefCell::new(UnpackBuf::default());
}

impl UnpackBuf {
    /// Room for rows of `nb` blocks (the buffers then hold `nb` entries each).
    fn size(&mut self, nb: usize) {
        self.q.resize(nb, [0; 32]);
        self.d.resize(nb, 0.0);
        self.m.resize(nb, 0.0);
        self.m_raw.resize(nb, [0; 2]);
    }

    /// `row` (at most the sized block count) unpacked: the same levels, scales and offsets
    /// the blocks give.
    #[inline(always)]
    fn unpack<B: Block32>(&mut self, row: &[B]) -> Unpacked<'_> {
        let nb = row.len().min(self.q.len());
        let offset = const { matches!(B::ORDER, Order::LanesOffset) };
        let (q, d, m) = (
            self.q.as_mut_ptr(),
            self.d.as_mut_ptr(),
            self.m.as_mut_ptr(),
        );
        // SAFETY: block indices below `nb`, inside `row` and every buffer; base Advanced SIMD.
        unsafe {
            let mut i = 0;
            while i + 4 <= nb {
                let x: [&B; 4] = std::array::from_fn(|k| row.get_unchecked(i + k));
                for (k, x) in x.iter().enumerate() {
                    let v = x.levels_neon();
                    let p = (*q.add(i + k)).as_mut_ptr();
                    vst1q_s8(p, v[0]);
                    vst1q_s8(p.add(16), v[1]);
                }
                vst1q_f32(d.add(i), scale4(x));
                if offset {
                    let raw = x.map(|x| x.offset_raw());
                    vst1q_f32(m.add(i), f16x4(raw));
                    self.m_raw[i..i + 4].copy_from_slice(&raw);
                }
                i += 4;
            }
            for i in i..nb {
                let x = row.get_unchecked(i);
                let v = x.levels_neon();
                let p = (*q.add(i)).as_mut_ptr();
                vst1q_s8(p, v[0]);
                vst1q_s8(p.add(16), v[1]);
                *d.add(i) = scale1(x);
                if offset {
                    *m.add(i) = arm::f16_to_f32(x.offset_raw());
                    self.m_raw[i] = x.offset_raw();
                }
            }
        }
        Unpacked {
            q: &self.q[..nb],
            d: &self.d[..nb],
            m: &self.m[..nb],
            m_raw: &self.m_raw[..nb],
        }
    }
}

/// [`Kernel::dot_wide`](super::super::format::Kernel::dot_wide) with `sdot`: each row is
/// unpacked once ([`UnpackBuf`]) and every group of 4 of the tokens (then the 1–3 left)
/// dotted with it as [`dot_group`] would (the same steps, so the same bits), reading the
/// levels and scales back instead of decoding the blocks once per group: for 16 tokens the
/// unpacking (IQ4_NL, MXFP4: `and`, `ushr` and two `tbl` per block) and its two stores are
/// paid once per row instead of four times.
///
/// # Safety
/// The CPU has FEAT_DotProd; `rows` lie inside `w`; `out[t].len() == rows.len()`.
#[target_feature(enable = "dotprod")]
pub(crate) unsafe fn wide_dotprod<B: Block32>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &[&ActBuf],
    out: &mut [&mut [f32]],
) {
    use super::super::format::Activation;
    use super::super::q8_0::ActQ8_0;
    let Some(last) = a.len().checked_sub(1) else {
        return;
    };
    let views: [&Q8Act; super::super::q8_k::WIDE] =
        std::array::from_fn(|k| ActQ8_0::view(a[k.min(last)]));
    let row = |r: usize| -> &[B] { blocks(&w[r * row_bytes..(r + 1) * row_bytes]) };
    // The buffer taken out of the thread-local and put back after: the loop stays in this
    // function (a closure has no target features, so the `sdot` steps, which need
    // FEAT_DotProd, would not be inlined into it).
    let mut buf = UNPACKED.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
    buf.size(row_bytes / std::mem::size_of::<B>());
    let first = rows.start;
    for r in rows.clone() {
        if r + 1 < rows.end {
            prefetch_lines(w, (r + 1) * row_bytes, row_bytes);
        }
        let u = buf.unpack(row(r));
        let mut t = 0;
        while t < a.len() {
            let n = (a.len() - t).min(4);
            let v = &views[t..];
            // SAFETY (every arm): dotprod is present (this function's contract).
            let got: [f32; 4] = unsafe {
                match n {
                    4 => core::<B, Sdot, _, 1, 4>([u], [v[0], v[1], v[2], v[3]])[0],
                    3 => {
                        let [x, y, z] = core::<B, Sdot, _, 1, 3>([u], [v[0], v[1], v[2]])[0];
                        [x, y, z, 0.0]
                    }
                    2 => {
                        let [x, y] = core::<B, Sdot, _, 1, 2>([u], [v[0], v[1]])[0];
                        [x, y, 0.0, 0.0]
                    }
                    _ => [core::<B, Sdot, _, 1, 1>([u], [v[0]])[0][0], 0.0, 0.0, 0.0],
                }
            };
            for k in 0..n {
                out[t + k][r - first] = got[k];
            }
            t += n;
        }
    }
    UNPACKED.with(|cell| *cell.borrow_mut() = buf);
}

/// NEON pieces the formats build their levels from.
pub(crate) mod levels {
    use std::arch::aarch64::*;

    /// The 32 nibbles of 16 packed bytes: values 0–15 (low nibbles) and 16–31 (high).
    #[inline(always)]
    pub fn nibbles(qs: &[u8; 16]) -> [uint8x16_t; 2] {
        // SAFETY: 16 bytes; base Advanced SIMD.
        unsafe {
            let x = vld1q_u8(qs.as_ptr());
            [vandq_u8(x, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(x)]
        }
    }

    /// `table[n]` for each nibble byte `n`.
    #[inline(always)]
    pub fn lookup(table: &[i8; 16], idx: [uint8x16_t; 2]) -> [int8x16_t; 2] {
        // SAFETY: 16 bytes; base Advanced SIMD.
        unsafe {
            let t = vld1q_s8(table.as_ptr());
            [vqtbl1q_s8(t, idx[0]), vqtbl1q_s8(t, idx[1])]
        }
    }

    /// Eight bytes from one byte `b`: byte `j` is `set` where bit `j` of `b` is set, else
    /// `clear`, for every `b`.
    pub const fn spread_table(set: u8, clear: u8) -> [u64; 256] {
        let mut t = [0u64; 256];
        let mut b = 0;
        while b < 256 {
            let mut j = 0;
            let mut v = 0u64;
            while j < 8 {
                let byte = if (b >> j) & 1 == 1 { set } else { clear };
                v |= (byte as u64) << (8 * j);
                j += 1;
            }
            t[b] = v;
            b += 1;
        }
        t
    }

    /// The 32 bytes `spread[qh byte]` of a little-endian fifth-bit word: byte `i` comes from
    /// bit `i` of `qh` (values 0–15, 16–31). Loads straight into the vector registers (`ldr d`)
    /// and one `zip1` per 16 bytes: none of the moves from general registers that cost three
    /// cycles of Neoverse N2's one M0 pipe each (loading into the upper half, `ld1 {v.d}[1]`,
    /// is as many vector µops with a longer latency, and priced slower).
    #[inline(always)]
    pub fn fifth_bits(qh: [u8; 4], spread: &[u64; 256]) -> [uint8x16_t; 2] {
        let p = qh.map(|b| &spread[b as usize] as *const u64);
        // SAFETY: each pointer is an entry of `spread`; base Advanced SIMD.
        unsafe {
            [0, 2].map(|k| {
                let lo = vcombine_u64(vld1_u64(p[k]), vdup_n_u64(0));
                let hi = vcombine_u64(vld1_u64(p[k + 1]), vdup_n_u64(0));
                vreinterpretq_u8_u64(vzip1q_u64(lo, hi))
            })
        }
    }

    /// The 32 five-bit levels of a block from its nibbles `qs` and its fifth-bit word `qh`
    /// spread by `spread` (the high four bits of each byte: the fifth bit and, for Q5_0, the
    /// offset). Two instructions for the 32 bytes past the loads: `bit` inserts the low
    /// nibbles under the spread bytes' high halves, `sri` the high nibbles shifted down (where
    /// `and`, `ushr` and two `orr` would be four).
    #[inline(always)]
    pub fn five(qs: &[u8; 16], qh: [u8; 4], spread: &[u64; 256]) -> [int8x16_t; 2] {
        let h = fifth_bits(qh, spread);
        // SAFETY: 16 bytes; base Advanced SIMD, register-only past the load.
        unsafe {
            let x = vld1q_u8(qs.as_ptr());
            let lo = vbslq_u8(vdupq_n_u8(0x0F), x, h[0]);
            let hi = vsriq_n_u8::<4>(h[1], x);
            [vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi)]
        }
    }
}
