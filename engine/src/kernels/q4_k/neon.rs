//! Q4_K on aarch64: the NEON (`smull`), dotprod (`sdot`) and i8mm (`smmla`) levels.
//!
//! Why this exists: Q4_K is the expert format of Q4_K_M files, so on a phone it is most of the
//! bytes a token streams and most of a prompt's multiplies. Every level computes the scalar's
//! exact integers per super-block (`sumi = Σ_j sc_j · Σ q·a`, `summ = Σ_j m_j · (bsum_2j +
//! bsum_2j+1)`) and then takes its two fused multiply-adds, `acc_d = fma(sumi, d·d_a, acc_d)`
//! and `acc_m = fma(summ, dmin·d_a, acc_m)`, with `[sumi, summ]` in lanes 0 and 1 of one vector
//! (one conversion, one multiply, one `fmla`), so every level has the bits of
//! [`super::dot_scalar`].
//!
//! - NEON: per sub-block of 32 values four `smull`/`smlal` (i16 lanes, ≤ 4 · 15 · 127), then
//!   two `smlal` by the sub-block's scale into i32.
//! - dotprod: two running `sdot` chains (low- and high-nibble sub-blocks) and per sub-block one
//!   `mla` by a scale difference (summation by parts, see [`dot_n`]), the coefficients decoded
//!   on the scalar pipes; the grouped kernel unpacks each block once for up to 4 tokens.
//! - i8mm (prefill, [`dot_wide`]): `smmla` takes 2 tokens × 2 rows × 8 values; per sub-block
//!   four of them give the 2 × 2 exact sums, then one `mla` by the two rows' scales. The
//!   minimums' term is a 2 × 2 × 8 product too (the 8 sub-blocks are its depth): each token's
//!   8 pair sums split as `lo + 256 · hi` (a byte and a signed byte, packed once per call), so
//!   `usmmla` and `smmla` against the rows' 8 minimums give `summ` exactly.

use super::super::format::{
    prefetch_lines, Activation, Dotprod, I8mm, Kernel, Neon, PREFETCH_AHEAD,
};
use super::super::neon::{f16x4_to_f32, sdot, smmla, usmmla, zeros_by_load};
use super::super::q8_k::{by_row_steps, ActQ8K, BlockQ8K, PackRing, WIDE};
use super::super::{blocks, ActBuf};
use super::{BlockQ4K, Q4K};
use std::arch::aarch64::*;
use std::ops::Range;

/// `acc + a · b[L]` in each i32 lane (`mla` by element). Inline assembly so that LLVM keeps
/// the by-element form: it rewrites the intrinsic, when `b` is a widened vector, into a `dup`
/// and a widening per lane (two more instructions per multiply).
#[inline(always)]
pub(crate) fn mla_lane<const L: i32>(mut acc: int32x4_t, a: int32x4_t, b: int32x4_t) -> int32x4_t {
    const { assert!(L >= 0 && L < 4) };
    // SAFETY: register-only base Advanced SIMD instruction.
    unsafe {
        std::arch::asm!(
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

/// `a · b[L]` in each i32 lane (`mul` by element; see [`mla_lane`]).
#[inline(always)]
pub(crate) fn mul_lane<const L: i32>(a: int32x4_t, b: int32x4_t) -> int32x4_t {
    const { assert!(L >= 0 && L < 4) };
    let out: int32x4_t;
    // SAFETY: register-only base Advanced SIMD instruction.
    unsafe {
        std::arch::asm!(
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

/// The 4 bytes of `w` as the 4 u16 lanes of a u64.
#[inline(always)]
pub(crate) fn spread_bytes(w: u32) -> u64 {
    let x = w as u64;
    let x = (x | (x << 16)) & 0x0000_ffff_0000_ffff;
    (x | (x << 8)) & 0x00ff_00ff_00ff_00ff
}

/// `[v0 − v1, v1 − v2, v2 − v3, v3 − n0]` for the u16 lanes of `v` and `next` (each < 2^15),
/// as i16 lanes: the differences summation by parts multiplies the running sums by. One
/// subtraction, the borrow between lanes blocked by the top bit of each lane.
#[inline(always)]
pub(crate) fn lane_diffs(v: u64, next: u64) -> u64 {
    const TOP: u64 = 0x8000_8000_8000_8000;
    ((v | TOP) - ((v >> 16) | (next << 48))) ^ TOP
}

/// Two u64 as one vector (lanes 0–3 from `lo`), for the coefficients the scalar pipes decode.
#[inline(always)]
pub(crate) fn vector_of(lo: u64, hi: u64) -> int16x8_t {
    // SAFETY: base Advanced SIMD, register-only.
    unsafe { vreinterpretq_s16_u64(vcombine_u64(vcreate_u64(lo), vcreate_u64(hi))) }
}

/// Per block, decoded on the scalar pipes (the vector pipes are the one-token dot's bound):
/// the differences of the scales along the two chains of [`dot_n`] (sub-blocks 0, 2, 4, 6:
/// `[sc0 − sc2, sc2 − sc4, sc4 − sc6, sc6]`, then the odd ones) as i32 lanes, and the 8
/// minimums as i16.
///
/// # Safety
/// Base Advanced SIMD.
#[inline(always)]
unsafe fn chain_coefficients(scales: &[u8; 12]) -> (int32x4_t, int32x4_t, int16x8_t) {
    const EVEN: u32 = 0x00ff_00ff;
    let [w0, w1, w2, w3] = scale_words(scales);
    let even = (w0 & EVEN) as u64 | (((w1 & EVEN) as u64) << 32);
    let odd = ((w0 >> 8) & EVEN) as u64 | ((((w1 >> 8) & EVEN) as u64) << 32);
    let d = vector_of(lane_diffs(even, 0), lane_diffs(odd, 0));
    let m16 = vector_of(spread_bytes(w2), spread_bytes(w3));
    // SAFETY: base Advanced SIMD, register-only.
    unsafe { (vmovl_s16(vget_low_s16(d)), vmovl_high_s16(d), m16) }
}

/// The scales and minimums of a Q4_K/Q5_K block from its first 16 bytes (`d`, `dmin`,
/// `scales`), as bytes: 0–7 the 8 scales, 8–15 the 8 minimums. [`super::scale_words`] done
/// on the three words in one register.
///
/// # Safety
/// Base Advanced SIMD (every aarch64 core).
#[inline(always)]
pub(crate) unsafe fn scale_bytes(head: uint8x16_t) -> uint8x16_t {
    // SAFETY (every intrinsic): base Advanced SIMD, register-only; the constant loads read
    // 16-byte arrays.
    unsafe {
        // head as u32 lanes: [d | dmin, u0, u1, u2].
        const A: [u8; 16] = [4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15];
        const B: [u8; 16] = [4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 11];
        const SHIFT: [i32; 4] = [0, 0, 0, -4];
        const LOW: [u32; 4] = [0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f, 0x0f0f_0f0f];
        const HIGH: [u32; 4] = [0, 0x3030_3030, 0, 0x3030_3030];
        // [u0, u2, u1, u2 >> 4] masked: the low bits of all 16 fields.
        let a = vreinterpretq_u32_u8(vqtbl1q_u8(head, vld1q_u8(A.as_ptr())));
        let low = vandq_u32(
            vshlq_u32(a, vld1q_s32(SHIFT.as_ptr())),
            vld1q_u32(LOW.as_ptr()),
        );
        // [u0, u0, u1, u1] >> 2: the top two bits of fields 0–3 moved to bits 4–5 of 4–7.
        let b = vreinterpretq_u32_u8(vqtbl1q_u8(head, vld1q_u8(B.as_ptr())));
        let high = vandq_u32(vshrq_n_u32::<2>(b), vld1q_u32(HIGH.as_ptr()));
        vreinterpretq_u8_u32(vorrq_u32(low, high))
    }
}

/// `[d, dmin, ·, ·]` widened from the block head's first two f16 (lanes 2 and 3 are scale bits
/// read as f16: never used).
#[inline(always)]
pub(crate) fn super_scales(head: uint8x16_t) -> float32x4_t {
    // SAFETY: base Advanced SIMD, register-only.
    f16x4_to_f32(unsafe { vget_low_u16(vreinterpretq_u16_u8(head)) })
}

/// `[d, dmin, 0, 0]` widened from the two f16 (one little-endian word, as loaded by the
/// scalar pipes: a vector load of the block head would overlap the scales they decode, and
/// LLVM then takes those from the vector lane by lane).
#[inline(always)]
pub(crate) fn super_scales_bits(bits: u32) -> float32x4_t {
    // SAFETY: base Advanced SIMD, register-only.
    f16x4_to_f32(unsafe { vcreate_u16(bits as u64) })
}

/// The little-endian u32 at byte `at` of `bytes` (one `ldr`: built from bytes, LLVM loads the
/// scale words byte by byte).
#[inline(always)]
pub(crate) fn word_at<const N: usize>(bytes: &[u8; N], at: usize) -> u32 {
    assert!(at + 4 <= N);
    // SAFETY: 4 bytes inside the array (checked above; `at` is a constant at every call, so the
    // check folds away); any bits are a valid u32.
    u32::from_le(unsafe { bytes.as_ptr().add(at).cast::<u32>().read_unaligned() })
}

/// [`super::scale_words`] with the three words loaded whole.
#[inline(always)]
pub(crate) fn scale_words(s: &[u8; 12]) -> [u32; 4] {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    let (u0, u1, u2) = (word_at(s, 0), word_at(s, 4), word_at(s, 8));
    [
        u0 & LOW6,
        (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4),
        u1 & LOW6,
        ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4),
    ]
}

/// The 16 head bytes of block `x`.
///
/// # Safety
/// Base Advanced SIMD.
#[inline(always)]
unsafe fn head(x: &BlockQ4K) -> uint8x16_t {
    // SAFETY: the block is 144 bytes; its first 16 are d, dmin, scales.
    unsafe { vld1q_u8((x as *const BlockQ4K).cast()) }
}

/// `Σ_j m_j · (bsum_2j + bsum_2j+1)` spread over 4 i32 lanes (exact), the minimums as i16.
///
/// # Safety
/// Base Advanced SIMD.
#[inline(always)]
pub(crate) unsafe fn mins_lanes(m16: int16x8_t, y: &BlockQ8K) -> int32x4_t {
    // SAFETY: 16 i16 = two 8-lane loads; register-only arithmetic. Pair sums ≤ 2 · 16 · 127
    // fit i16, times ≤ 63 fit i32.
    unsafe {
        let bs = y.bsums.as_ptr();
        let p = vpaddq_s16(vld1q_s16(bs), vld1q_s16(bs.add(8)));
        vmlal_high_s16(vmull_s16(vget_low_s16(p), vget_low_s16(m16)), p, m16)
    }
}

/// One super-block's float step: `[sumi, summ]` (the totals of `sumi` and `summ`, exact)
/// into lanes 0 and 1 of `acc` by one fused multiply-add with `[d·d_a, dmin·d_a]`.
///
/// # Safety
/// Base Advanced SIMD.
#[inline(always)]
unsafe fn step(
    acc: float32x4_t,
    sumi: int32x4_t,
    summ: int32x4_t,
    dd: float32x4_t,
    d_a: f32,
) -> float32x4_t {
    // SAFETY: base Advanced SIMD, register-only.
    unsafe {
        let h = vpaddq_s32(sumi, summ);
        let tot = vpaddq_s32(h, h); // [sumi, summ, sumi, summ]
        vfmaq_f32(acc, vcvtq_f32_s32(tot), vmulq_n_f32(dd, d_a))
    }
}

/// `acc_d − acc_m` from the accumulator vector.
#[inline(always)]
fn finish(acc: float32x4_t) -> f32 {
    // SAFETY: base Advanced SIMD, register-only.
    unsafe { vgetq_lane_f32::<0>(acc) - vgetq_lane_f32::<1>(acc) }
}

impl Kernel<Q4K> for Neon {
    unsafe fn dot(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: base Advanced SIMD (every aarch64 core).
        unsafe { dot_neon(w, a) }
    }
}

/// The NEON dot: per sub-block four `smull`/`smlal` into i16 lanes (≤ 4 · 15 · 127), then
/// `smlal` by the scale into the i32 sum.
///
/// # Safety
/// Base Advanced SIMD.
unsafe fn dot_neon(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
    // SAFETY (every intrinsic): base Advanced SIMD; loads stay inside the blocks (32 bytes at
    // 32c of 128 qs, 64 bytes at 64c of 256 activation bytes).
    unsafe {
        const SC16: [u8; 16] = [
            0, 255, 1, 255, 2, 255, 3, 255, 4, 255, 5, 255, 6, 255, 7, 255,
        ];
        let m4 = vdupq_n_u8(0x0F);
        let sc16_idx = vld1q_u8(SC16.as_ptr());
        let mut acc = vdupq_n_f32(0.0);
        for (x, y) in w.iter().zip(a) {
            let h = head(x);
            let sm = scale_bytes(h);
            let sc = vreinterpretq_s16_u8(vqtbl1q_u8(sm, sc16_idx));
            let m16 = vreinterpretq_s16_u16(vmovl_high_u8(sm));
            let mut sumi = vdupq_n_s32(0);
            macro_rules! chunk {
                ($c:literal, $l0:literal, $l1:literal) => {{
                    let q = vld1q_u8_x2(x.qs.as_ptr().add(32 * $c));
                    let ya = vld1q_s8_x4(y.qs.as_ptr().add(64 * $c));
                    let lo = |v: uint8x16_t| vreinterpretq_s8_u8(vandq_u8(v, m4));
                    let hi = |v: uint8x16_t| vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
                    let prod = |w0: int8x16_t, w1: int8x16_t, a0: int8x16_t, a1: int8x16_t| {
                        let p = vmull_s8(vget_low_s8(w0), vget_low_s8(a0));
                        let p = vmlal_high_s8(p, w0, a0);
                        let p = vmlal_s8(p, vget_low_s8(w1), vget_low_s8(a1));
                        vmlal_high_s8(p, w1, a1)
                    };
                    let pl = prod(lo(q.0), lo(q.1), ya.0, ya.1);
                    let ph = prod(hi(q.0), hi(q.1), ya.2, ya.3);
                    sumi = vmlal_laneq_s16::<$l0>(sumi, vget_low_s16(pl), sc);
                    sumi = vmlal_high_laneq_s16::<$l0>(sumi, pl, sc);
                    sumi = vmlal_laneq_s16::<$l1>(sumi, vget_low_s16(ph), sc);
                    sumi = vmlal_high_laneq_s16::<$l1>(sumi, ph, sc);
                }};
            }
            chunk!(0, 0, 1);
            chunk!(1, 2, 3);
            chunk!(2, 4, 5);
            chunk!(3, 6, 7);
            acc = step(acc, sumi, mins_lanes(m16, y), super_scales(h), y.d);
        }
        finish(acc)
    }
}

impl Kernel<Q4K> for Dotprod {
    unsafe fn dot(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (dotprod is present).
        let [v] = unsafe { dot_n::<1>(w, [a]) };
        v
    }

    /// Two rows a step ([`dot_rows2`]).
    unsafe fn dot_rows(
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
        a: &[BlockQ8K],
        out: &mut [f32],
    ) {
        // SAFETY: the caller's (dotprod is present).
        unsafe { rows_dotprod(w, row_bytes, rows, a, out) }
    }

    /// Each block's nibbles and scales unpacked once for all the group's tokens.
    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ4K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n::<N>(w, a) }
    }
}

impl Kernel<Q4K> for I8mm {
    unsafe fn dot(w: &[BlockQ4K], a: &[BlockQ8K]) -> f32 {
        // SAFETY: the caller's (i8mm implies dotprod here: the level includes it).
        let [v] = unsafe { dot_n::<1>(w, [a]) };
        v
    }

    /// Two rows a step ([`dot_rows2`]).
    unsafe fn dot_rows(
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
        a: &[BlockQ8K],
        out: &mut [f32],
    ) {
        // SAFETY: the caller's (the i8mm level includes dotprod).
        unsafe { rows_dotprod(w, row_bytes, rows, a, out) }
    }

    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ4K], a: [&[BlockQ8K]; N]) -> [f32; N] {
        // SAFETY: the caller's.
        unsafe { dot_n::<N>(w, a) }
    }

    const WIDE: bool = true;

    /// From 2 tokens on (llvm-mca, cycles per 256 weights and token, Neoverse N2 / V1: lanes
    /// kernel 19.3 / 10.5 at 2 tokens, 13.5 / 7.3 at 4, 11.5 / 5.8 at 8–16; grouped dotprod
    /// kernel 23.3 / 11.7 at 2, 20.1 / 10.1 at 4; one-token dot 29.8 / 14.6; a lone token in
    /// the lanes kernel, 38.6 / 21.1, is the one case it loses).
    const WIDE_MIN: usize = 2;

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

/// One row against `N` tokens (`1 <= N <= 4`): per block the coefficients are decoded (on
/// the scalar pipes) and each chunk's nibbles unpacked once, then per token two running
/// `sdot` chains, one over the low-nibble sub-blocks 0, 2, 4, 6 and one over the high-nibble
/// ones, and after each sub-block one `mla` of the chain by the difference of its scale and
/// the chain's next (summation by parts: `Σ_j sc_j · P_j = Σ_j C_j · (sc_j − sc_j+2)` with
/// `C_j` the running sum and `sc_8 = sc_9 = 0`, exact in wrapping i32 since the true sum
/// fits). No fresh zero per sub-block: the vector pipes bound this loop.
///
/// # Safety
/// The CPU has FEAT_DotProd.
#[target_feature(enable = "dotprod")]
#[inline]
unsafe fn dot_n<const N: usize>(w: &[BlockQ4K], a: [&[BlockQ8K]; N]) -> [f32; N] {
    let n = a.iter().fold(w.len(), |n, a| n.min(a.len()));
    // SAFETY (every intrinsic and load): dotprod is present (the caller's); loads stay inside
    // the blocks (32 bytes at 32c of 128 qs, 64 bytes at 64c of 256 activation bytes).
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        let zero = vdupq_n_s32(0);
        let mut acc = [vdupq_n_f32(0.0); N];
        for (i, x) in w[..n].iter().enumerate() {
            let (dl, dh, m16) = chain_coefficients(&x.scales);
            let mut run = [[zero; 2]; N];
            let mut sumi = [zero; N];
            macro_rules! chunk {
                ($c:literal) => {{
                    let q = vld1q_u8_x2(x.qs.as_ptr().add(32 * $c));
                    let lo0 = vreinterpretq_s8_u8(vandq_u8(q.0, m4));
                    let lo1 = vreinterpretq_s8_u8(vandq_u8(q.1, m4));
                    let hi0 = vreinterpretq_s8_u8(vshrq_n_u8::<4>(q.0));
                    let hi1 = vreinterpretq_s8_u8(vshrq_n_u8::<4>(q.1));
                    for t in 0..N {
                        let ya = vld1q_s8_x4(a[t][i].qs.as_ptr().add(64 * $c));
                        let r = &mut run[t];
                        // Running sums ≤ 4 · 32 · 15 · 127 per lane.
                        r[0] = sdot(sdot(r[0], lo0, ya.0), lo1, ya.1);
                        r[1] = sdot(sdot(r[1], hi0, ya.2), hi1, ya.3);
                        sumi[t] = if $c == 0 {
                            mul_lane::<0>(r[0], dl)
                        } else {
                            mla_lane::<$c>(sumi[t], r[0], dl)
                        };
                        sumi[t] = mla_lane::<$c>(sumi[t], r[1], dh);
                    }
                }};
            }
            chunk!(0);
            chunk!(1);
            chunk!(2);
            chunk!(3);
            // SAFETY: the block's first 4 bytes are d and dmin.
            let dd = super_scales_bits(u32::from_le(
                (x as *const BlockQ4K).cast::<u32>().read_unaligned(),
            ));
            for t in 0..N {
                let y = &a[t][i];
                acc[t] = step(acc[t], sumi[t], mins_lanes(m16, y), dd, y.d);
            }
        }
        acc.map(finish)
    }
}

/// [`Kernel::dot_rows`] at dotprod: two rows a step ([`dot_rows2`]), a last odd row alone,
/// each row prefetched as the default does.
///
/// # Safety
/// The CPU has FEAT_DotProd; `rows` lie inside `w` (whole `row_bytes` rows).
#[target_feature(enable = "dotprod")]
unsafe fn rows_dotprod(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &[BlockQ8K],
    out: &mut [f32],
) {
    let row = |r: usize| -> &[BlockQ4K] { blocks(&w[r * row_bytes..(r + 1) * row_bytes]) };
    let (first, mut r) = (rows.start, rows.start);
    while r < rows.end {
        let n = (rows.end - r).min(2);
        prefetch_lines(w, r * row_bytes + PREFETCH_AHEAD, n * row_bytes);
        let o = &mut out[r - first..r - first + n];
        // SAFETY (both arms): dotprod is the caller's.
        unsafe {
            if n == 2 {
                o.copy_from_slice(&dot_rows2([row(r), row(r + 1)], a));
            } else {
                o[0] = dot_n::<1>(row(r), [a])[0];
            }
        }
        r += n;
    }
}

/// Two rows against one token: [`dot_n`]'s integers for each row, then the two rows' float
/// steps as one: `[sumi_0, summ_0, sumi_1, summ_1]` in one vector, one conversion, one
/// multiply by `[d_0, dmin_0, d_1, dmin_1] · d_a` (the four f16 widened by one `fcvtl`) and
/// one `fmla` into `[acc_d, acc_m]` of both rows; the token's block sums paired once for
/// both. Each lane is its row's scalar step, so each row has [`dot_n`]'s bits. (llvm-mca,
/// cycles per 256 weights on Neoverse N2 / V1: 30.6 / 15.3 a row at a time, 25.3 / 13.3
/// in pairs, their running sums zeroed by loads.)
///
/// # Safety
/// The CPU has FEAT_DotProd.
#[target_feature(enable = "dotprod")]
#[inline]
unsafe fn dot_rows2(w: [&[BlockQ4K]; 2], a: &[BlockQ8K]) -> [f32; 2] {
    let n = w[0].len().min(w[1].len()).min(a.len());
    // SAFETY (every intrinsic and load): dotprod is present (the caller's); loads stay inside
    // the blocks (32 bytes at 32c of 128 qs, 64 bytes at 64c of 256 activation bytes, the
    // 32 bytes of bsums, each row block's first 4 bytes).
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        let zero = vdupq_n_s32(0);
        // [acc_d, acc_m] of row 0, then of row 1.
        let mut acc = vdupq_n_f32(0.0);
        for i in 0..n {
            let y = &a[i];
            let x = [&w[0][i], &w[1][i]];
            let coef = x.map(|x| chain_coefficients(&x.scales));
            // Fresh running sums from a load pipe (see `zeros_by_load`).
            let mut run: [[int32x4_t; 2]; 2] =
                std::array::from_fn(|_| [zeros_by_load(), zeros_by_load()]);
            let mut sumi = [zero; 2];
            macro_rules! chunk {
                ($c:literal) => {{
                    let ya = vld1q_s8_x4(y.qs.as_ptr().add(64 * $c));
                    for r in 0..2 {
                        let q = vld1q_u8_x2(x[r].qs.as_ptr().add(32 * $c));
                        let lo0 = vreinterpretq_s8_u8(vandq_u8(q.0, m4));
                        let lo1 = vreinterpretq_s8_u8(vandq_u8(q.1, m4));
                        let hi0 = vreinterpretq_s8_u8(vshrq_n_u8::<4>(q.0));
                        let hi1 = vreinterpretq_s8_u8(vshrq_n_u8::<4>(q.1));
                        let (dl, dh, _) = coef[r];
                        let run = &mut run[r];
                        // Running sums ≤ 4 · 32 · 15 · 127 per lane.
                        run[0] = sdot(sdot(run[0], lo0, ya.0), lo1, ya.1);
                        run[1] = sdot(sdot(run[1], hi0, ya.2), hi1, ya.3);
                        sumi[r] = if $c == 0 {
                            mul_lane::<0>(run[0], dl)
                        } else {
                            mla_lane::<$c>(sumi[r], run[0], dl)
                        };
                        sumi[r] = mla_lane::<$c>(sumi[r], run[1], dh);
                    }
                }};
            }
            chunk!(0);
            chunk!(1);
            chunk!(2);
            chunk!(3);
            // Pair sums ≤ 2 · 16 · 127 fit i16, times ≤ 63 fit i32.
            let bs = y.bsums.as_ptr();
            let p = vpaddq_s16(vld1q_s16(bs), vld1q_s16(bs.add(8)));
            let summ = coef.map(|(_, _, m16)| {
                vmlal_high_s16(vmull_s16(vget_low_s16(p), vget_low_s16(m16)), p, m16)
            });
            let tot = vpaddq_s32(vpaddq_s32(sumi[0], summ[0]), vpaddq_s32(sumi[1], summ[1]));
            // The rows' first 4 bytes: d and dmin.
            let head =
                x.map(|x| u32::from_le((x as *const BlockQ4K).cast::<u32>().read_unaligned()));
            let dd = f16x4_to_f32(vcreate_u16(head[0] as u64 | (head[1] as u64) << 32));
            acc = vfmaq_f32(acc, vcvtq_f32_s32(tot), vmulq_n_f32(dd, y.d));
        }
        [
            vgetq_lane_f32::<0>(acc) - vgetq_lane_f32::<1>(acc),
            vgetq_lane_f32::<2>(acc) - vgetq_lane_f32::<3>(acc),
        ]
    }
}

/// Token pairs a pass of [`pairs`] keeps in registers (their two accumulators each, and one
/// row pair's unpacked chunk).
const PASS: usize = 4;

/// Up to [`WIDE`] tokens' Q8_K blocks packed for `smmla`, by pairs of tokens (an odd last
/// token is paired with zeros): shared by the Q4_K and Q5_K lanes kernels, which differ only in
/// the order of the values (`groups`, see [`Pairs::fill`]). For pair `p` and block `b`, at `k =
/// p · nb + b`: `qs[32k + g]` = the two tokens' values of group `g` (first token in bytes 0–7),
/// `lo[k]` / `hi[k]` = their 8 pair sums `bsum_2j + bsum_2j+1` as `lo + 256 · hi` (a byte, a
/// signed byte; each token's 8 in its half), `d[k]` = `[d_0, d_0, d_1, d_1]`, the layout of the
/// `smmla` results `[t0·r0, t0·r1, t1·r0, t1·r1]`.
#[derive(Default)]
pub(crate) struct Pairs {
    pub qs: Vec<[i8; 16]>,
    pub lo: Vec<[u8; 16]>,
    pub hi: Vec<[i8; 16]>,
    pub d: Vec<[f32; 4]>,
    pub nb: usize,
    /// The tokens' [`ActBuf::stamp`]s and block count these hold.
    key: (Vec<u64>, usize),
}

impl Pairs {
    pub fn holds(&self, acts: &[&ActBuf], nb: usize) -> bool {
        let (stamps, key_nb) = &self.key;
        *key_nb == nb
            && stamps.len() == acts.len()
            && stamps.iter().zip(acts).all(|(s, a)| *s == a.stamp())
    }

    /// Packs the first `nb` blocks of `acts`; group `g` (0..32) of a block is the 4 values
    /// from `groups(g)[0]` and the 4 from `groups(g)[1]` (both `<= 252`).
    pub fn fill(&mut self, acts: &[&ActBuf], nb: usize, groups: impl Fn(usize) -> [usize; 2]) {
        self.key.0.clear();
        self.key.0.extend(acts.iter().map(|a| a.stamp()));
        self.key.1 = nb;
        self.nb = nb;
        let n = acts.len().div_ceil(2) * nb;
        self.qs.clear();
        self.qs.resize(32 * n, [0; 16]);
        self.lo.clear();
        self.lo.resize(n, [0; 16]);
        self.hi.clear();
        self.hi.resize(n, [0; 16]);
        self.d.clear();
        self.d.resize(n, [0.0; 4]);
        let starts: [[usize; 2]; 32] = std::array::from_fn(&groups);
        for (t, act) in acts.iter().enumerate().take(WIDE) {
            let (p, half) = (t / 2, t % 2);
            for (b, y) in ActQ8K::view(act)[..nb].iter().enumerate() {
                let k = p * nb + b;
                for (g, [s0, s1]) in starts.iter().enumerate() {
                    let q = &mut self.qs[32 * k + g][8 * half..8 * half + 8];
                    q[..4].copy_from_slice(&y.qs[*s0..*s0 + 4]);
                    q[4..].copy_from_slice(&y.qs[*s1..*s1 + 4]);
                }
                for j in 0..8 {
                    // ≤ 2 · 16 · 127 in magnitude: lo + 256 · hi with hi in -16..=15.
                    let s = y.bsums[2 * j] + y.bsums[2 * j + 1];
                    self.lo[k][8 * half + j] = s as u8;
                    self.hi[k][8 * half + j] = (s >> 8) as i8;
                }
                self.d[k][2 * half] = y.d;
                self.d[k][2 * half + 1] = y.d;
            }
        }
    }
}

thread_local! {
    /// The token packings of this thread's recent calls (a product's row bands reuse them).
    static PAIRS: std::cell::RefCell<PackRing<Pairs>> = std::cell::RefCell::new(PackRing::default());
}

/// Rows `rows` against `1 <= a.len() <= WIDE` tokens: two rows at a time (a last single row
/// is paired with itself), the tokens by pairs in passes of [`PASS`] pairs ([`pairs`]).
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
    let nb = row_bytes / std::mem::size_of::<BlockQ4K>();
    let nb = a.iter().fold(nb, |n, a| n.min(ActQ8K::view(a).len()));
    let n_pairs = a.len().min(WIDE).div_ceil(2);
    PAIRS.with(|cell| {
        let ring = &mut *cell.borrow_mut();
        // Group g: values 8g .. 8g + 8.
        let pack = ring.get(
            |p| p.holds(a, nb),
            |p| p.fill(a, nb, |g| [8 * g, 8 * g + 4]),
        );
        let row =
            |r: usize| -> &[BlockQ4K] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
        by_row_steps::<2>(w, row_bytes, rows, out, |r, n| {
            let (r0, r1) = (row(r), row(if n == 2 { r + 1 } else { r }));
            let mut v = [[0f32; WIDE]; 2];
            let mut p = 0;
            while p < n_pairs {
                let mut res = [[0f32; 4]; PASS];
                // SAFETY: i8mm and dotprod are present (the caller's); the pairs exist.
                let k = unsafe {
                    match n_pairs - p {
                        1 => spill(&mut res, pairs::<1>(r0, r1, pack, p)),
                        2 => spill(&mut res, pairs::<2>(r0, r1, pack, p)),
                        3 => spill(&mut res, pairs::<3>(r0, r1, pack, p)),
                        _ => spill(&mut res, pairs::<4>(r0, r1, pack, p)),
                    }
                };
                for (i, l) in res[..k].iter().enumerate() {
                    let t = 2 * (p + i);
                    [v[0][t], v[1][t], v[0][t + 1], v[1][t + 1]] = *l;
                }
                p += k;
            }
            v
        });
    });
}

/// Stores `K` result vectors into `res`; returns `K`.
#[inline(always)]
pub(crate) fn spill<const K: usize, const N: usize>(
    res: &mut [[f32; 4]; N],
    v: [float32x4_t; K],
) -> usize {
    for (r, v) in res.iter_mut().zip(v) {
        // SAFETY: 4 floats.
        unsafe { vst1q_f32(r.as_mut_ptr(), v) };
    }
    K
}

/// Rows `w0`, `w1` against token pairs `first .. first + K` of `pack`: per block the two
/// rows' chunk of 32 bytes is interleaved by 8 (`zip`) and unpacked to the 8 `smmla` operands
/// of its two sub-blocks, once for all `K` pairs; per pair and sub-block four `smmla` give the
/// exact 2 × 2 sums, one `mla` applies `[sc_r0, sc_r1, sc_r0, sc_r1]`. Then per pair the
/// minimums' term (`smmla`, shift, `usmmla`) and the two fused multiply-adds of every lane:
/// each (token, row) lane has the bits of [`super::dot_scalar`].
///
/// # Safety
/// The CPU has FEAT_I8MM and FEAT_DotProd; `first + K` pairs exist in `pack`, whose block
/// count is `w0.len() == w1.len()`.
#[target_feature(enable = "dotprod,i8mm")]
#[inline]
unsafe fn pairs<const K: usize>(
    w0: &[BlockQ4K],
    w1: &[BlockQ4K],
    pack: &Pairs,
    first: usize,
) -> [float32x4_t; K] {
    let nb = pack.nb;
    // SAFETY (every intrinsic and load): the features are present (the caller's); every index
    // is inside the packing (pairs < first + K, blocks < nb) or the blocks.
    unsafe {
        let m4 = vdupq_n_u8(0x0F);
        let zero = vdupq_n_s32(0);
        let mut acc_d = [vdupq_n_f32(0.0); K];
        let mut acc_m = [vdupq_n_f32(0.0); K];
        for b in 0..nb {
            let (x0, x1) = (&w0[b], &w1[b]);
            let (h0, h1) = (head(x0), head(x1));
            let (s0, s1) = (scale_bytes(h0), scale_bytes(h1));
            // [r0 sc_0, r1 sc_0, r0 sc_1, r1 sc_1, ...], then [r0 m_0..m_7 | r1 m_0..m_7].
            let sc = vzip1q_u8(s0, s1);
            let mins = vreinterpretq_s8_u64(vzip2q_u64(
                vreinterpretq_u64_u8(s0),
                vreinterpretq_u64_u8(s1),
            ));
            let sc16 = [vmovl_u8(vget_low_u8(sc)), vmovl_high_u8(sc)];
            let mut sumi = [zero; K];
            macro_rules! chunk {
                ($c:literal) => {{
                    // [r0 sc_2c, r1 sc_2c, r0 sc_2c+1, r1 sc_2c+1] as i32.
                    let s = vreinterpretq_u64_u32(if $c % 2 == 0 {
                        vmovl_u16(vget_low_u16(sc16[$c / 2]))
                    } else {
                        vmovl_high_u16(sc16[$c / 2])
                    });
                    let sc_lo = vreinterpretq_s32_u64(vdupq_laneq_u64::<0>(s));
                    let sc_hi = vreinterpretq_s32_u64(vdupq_laneq_u64::<1>(s));
                    let q0 = vld1q_u8_x2(x0.qs.as_ptr().add(32 * $c));
                    let q1 = vld1q_u8_x2(x1.qs.as_ptr().add(32 * $c));
                    let z = |a: uint8x16_t, b: uint8x16_t, high: bool| {
                        let (a, b) = (vreinterpretq_u64_u8(a), vreinterpretq_u64_u8(b));
                        vreinterpretq_u8_u64(if high {
                            vzip2q_u64(a, b)
                        } else {
                            vzip1q_u64(a, b)
                        })
                    };
                    // Bytes 8g .. 8g + 8 of both rows: values 8g .. of sub-block 2c (low
                    // nibbles) and of sub-block 2c + 1 (high nibbles).
                    let raw = [
                        z(q0.0, q1.0, false),
                        z(q0.0, q1.0, true),
                        z(q0.1, q1.1, false),
                        z(q0.1, q1.1, true),
                    ];
                    let wl = raw.map(|v| vreinterpretq_s8_u8(vandq_u8(v, m4)));
                    let wh = raw.map(|v| vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)));
                    for (k, s) in sumi.iter_mut().enumerate() {
                        let base = pack.qs.as_ptr().add(32 * ((first + k) * nb + b) + 8 * $c);
                        let y = |g: usize| vld1q_s8(base.add(g).cast::<i8>());
                        // ≤ 32 · 15 · 127 per lane.
                        let mut tl = smmla(zero, y(0), wl[0]);
                        let mut th = smmla(zero, y(4), wh[0]);
                        for g in 1..4 {
                            tl = smmla(tl, y(g), wl[g]);
                            th = smmla(th, y(4 + g), wh[g]);
                        }
                        *s = vmlaq_s32(*s, tl, sc_lo);
                        *s = vmlaq_s32(*s, th, sc_hi);
                    }
                }};
            }
            chunk!(0);
            chunk!(1);
            chunk!(2);
            chunk!(3);
            // [d_r0, d_r1, d_r0, d_r1] and the same of dmin.
            let dd = vzip1q_f32(super_scales(h0), super_scales(h1)); // [d0, d1, dmin0, dmin1]
            let dr = vcombine_f32(vget_low_f32(dd), vget_low_f32(dd));
            let mr = vcombine_f32(vget_high_f32(dd), vget_high_f32(dd));
            for k in 0..K {
                let at = (first + k) * nb + b;
                let lo = vld1q_u8(pack.lo[at].as_ptr());
                let hi = vld1q_s8(pack.hi[at].as_ptr());
                // Σ_j m_j · (lo_j + 256 · hi_j) = summ, exactly.
                let summ = usmmla(vshlq_n_s32::<8>(smmla(zero, hi, mins)), lo, mins);
                let dt = vld1q_f32(pack.d[at].as_ptr());
                acc_d[k] = vfmaq_f32(acc_d[k], vcvtq_f32_s32(sumi[k]), vmulq_f32(dt, dr));
                acc_m[k] = vfmaq_f32(acc_m[k], vcvtq_f32_s32(summ), vmulq_f32(dt, mr));
            }
        }
        std::array::from_fn(|k| vsubq_f32(acc_d[k], acc_m[k]))
    }
}
