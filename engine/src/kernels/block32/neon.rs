//! aarch64 kernels of the [`Block32`] formats (Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4): the scalar
//! reference's 8 lanes of exact 4-value sums and its float steps, written once for every
//! format, with each format's [`Block32::levels_neon`] turning a block into its 32 levels.
//!
//! Why this shape: a block's 32 products summed in 8 lanes of 4 consecutive values is exactly
//! what `sdot` leaves (16 bytes → 4 lanes), and what `smull` + `addp` + `sadalp` leave without
//! FEAT_DotProd, so both levels share one loop ([`LaneDot`] is the only difference).
//!
//! The lane sums are never converted with `scvtf` (two µops on one pipe of Neoverse N2 and
//! V1): each row keeps a running integer sum per lane started at `MAGIC` = 1.5 · 2^23, whose
//! bits read as a float are exactly `MAGIC + sum` while `|sum| < 2^22`; a block's sums are then
//! the float difference of two consecutive running sums (exact: both lie in [2^23, 2^24)).
//! Sums restart every [`CHUNK`] blocks, which keeps `|sum| ≤ 64 · 4 · 127 · 127 < 2^22`. That
//! turns "zero the accumulator, convert" into one `fsub` per 4 lanes, and changes no bit: the
//! float steps are the scalar's (`lane = fma(d_w·d_a, sum, lane)` per block, [`Order`]).
//!
//! Prefill: [`dot_group`] unpacks each weight block once for up to 4 tokens; decode:
//! [`dot_rows`] runs two rows at once (two independent chains of fused steps, and one
//! activation load for both).

use super::super::blocks;
use super::super::format::{prefetch_lines, PREFETCH_AHEAD};
use super::super::neon as arm;
use super::super::q8_0::{BlockQ8_0, Q8Act};
use super::{Block32, Order, Scale};
use std::arch::aarch64::*;
use std::ops::Range;

/// 1.5 · 2^23 as f32 bits: the running lane sums' start (see the module header).
const MAGIC: i32 = 0x4B40_0000;
/// Blocks between restarts of the running sums: 64 blocks of lane sums of at most 4 · 127 ·
/// 127 stay below 2^22 in magnitude.
const CHUNK: usize = 64;
const _: () = assert!(CHUNK as i64 * 4 * 127 * 127 < 1 << 22);

/// One instruction set's 4-value dot: `acc[i] + Σ_{k<4} w[4i + k] · a[4i + k]` in each i32
/// lane, exactly (products of levels within ±127 and activations within ±127).
pub(crate) trait LaneDot {
    /// # Safety
    /// The CPU has what the implementation needs.
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t;
}

/// FEAT_DotProd's `sdot`.
pub(crate) struct Sdot;
impl LaneDot for Sdot {
    #[inline(always)]
    unsafe fn dot(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
        // SAFETY: the caller's (dotprod is present).
        unsafe { arm::sdot(acc, w, a) }
    }
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

/// What one block contributes per (row, token): the exact lane sums as floats, from the
/// running sums `run` (updated).
#[inline(always)]
unsafe fn lane_sums<D: LaneDot>(
    run: &mut [int32x4_t; 2],
    q: [int8x16_t; 2],
    y: [int8x16_t; 2],
) -> [float32x4_t; 2] {
    // SAFETY: the caller's (the level of `D`); register-only.
    unsafe {
        let s = [D::dot(run[0], q[0], y[0]), D::dot(run[1], q[1], y[1])];
        let f = [
            vsubq_f32(vreinterpretq_f32_s32(s[0]), vreinterpretq_f32_s32(run[0])),
            vsubq_f32(vreinterpretq_f32_s32(s[1]), vreinterpretq_f32_s32(run[1])),
        ];
        *run = s;
        f
    }
}

/// The dot products of `R` rows with `T` activations, `out[r][t]`, each with the bits of
/// [`super::dot_scalar`] (see the module header). `R · T` is small (at most 4).
#[inline(always)]
unsafe fn core<B: Block32, D: LaneDot, const R: usize, const T: usize>(
    w: [&[B]; R],
    a: [&Q8Act; T],
) -> [[f32; T]; R] {
    let offset = const { matches!(B::ORDER, Order::LanesOffset) };
    // The scalar's zips: the offset formats also stop at the activation's `s` terms.
    let n = w
        .iter()
        .map(|r| r.len())
        .chain(a.iter().map(|a| a.blocks.len()))
        .chain(a.iter().filter(|_| offset).map(|a| a.s.len()))
        .min()
        .unwrap_or(0);
    // Unchecked access below: every block index is below `n` (the loops' bounds).
    let (wp, ap) = (w.map(|r| r.as_ptr()), a.map(|a| a.blocks.as_ptr()));
    // SAFETY (both): `i < n`, inside every row and activation.
    let x = |r: usize, i: usize| -> &B { unsafe { &*wp[r].add(i) } };
    let y = |t: usize, i: usize| -> &BlockQ8_0 { unsafe { &*ap[t].add(i) } };
    let pairs = const { matches!(B::ORDER, Order::Pairs) };
    let in_lanes = if pairs { n / 2 * 2 } else { n };
    // SAFETY (the whole body): the caller's (the level of `D`); register-only intrinsics.
    unsafe {
        let zero = vdupq_n_f32(0.0);
        // acc[set][r][t]: lanes 0–3 and 4–7; set 1 holds the odd blocks of the Pairs order.
        let mut acc = [[[[zero; 2]; T]; R]; 2];
        let mut m_sum = [[0f32; T]; R];
        let magic = vdupq_n_s32(MAGIC);
        let mut b = 0;
        while b < in_lanes {
            let end = (b + CHUNK).min(in_lanes);
            let mut run = [[[magic; 2]; T]; R];
            // Four blocks a step: their scales converted four at a time.
            while b + 4 <= end {
                let da: [float32x4_t; T] =
                    std::array::from_fn(|t| f16x4(std::array::from_fn(|k| y(t, b + k).d)));
                let mut d = [[zero; T]; R];
                for (r, d) in d.iter_mut().enumerate() {
                    let dw = scale4(std::array::from_fn(|k| x(r, b + k)));
                    for t in 0..T {
                        d[t] = vmulq_f32(dw, da[t]);
                    }
                }
                macro_rules! step {
                    ($k:literal) => {{
                        let i = b + $k;
                        let set = if pairs { $k & 1 } else { 0 };
                        let ya: [[int8x16_t; 2]; T] = std::array::from_fn(|t| act(y(t, i)));
                        for r in 0..R {
                            let q = x(r, i).levels_neon();
                            for t in 0..T {
                                let f = lane_sums::<D>(&mut run[r][t], q, ya[t]);
                                let l = &mut acc[set][r][t];
                                l[0] = fma_lane::<$k>(l[0], f[0], d[r][t]);
                                l[1] = fma_lane::<$k>(l[1], f[1], d[r][t]);
                            }
                        }
                        if offset {
                            offset_step(
                                &mut m_sum,
                                std::array::from_fn(|r| x(r, i)),
                                std::array::from_fn(|t| *a[t].s.get_unchecked(i)),
                            );
                        }
                    }};
                }
                step!(0);
                step!(1);
                step!(2);
                step!(3);
                b += 4;
            }
            while b < end {
                let set = if pairs { b & 1 } else { 0 };
                for r in 0..R {
                    let q = x(r, b).levels_neon();
                    let dw = scale1(x(r, b));
                    for t in 0..T {
                        let d = vdupq_n_f32(dw * arm::f16_to_f32(y(t, b).d));
                        let f = lane_sums::<D>(&mut run[r][t], q, act(y(t, b)));
                        let l = &mut acc[set][r][t];
                        l[0] = vfmaq_f32(l[0], f[0], d);
                        l[1] = vfmaq_f32(l[1], f[1], d);
                    }
                }
                if offset {
                    offset_step(
                        &mut m_sum,
                        std::array::from_fn(|r| x(r, b)),
                        std::array::from_fn(|t| *a[t].s.get_unchecked(b)),
                    );
                }
                b += 1;
            }
        }
        let mut out = [[0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                let l = if pairs {
                    [
                        vaddq_f32(acc[0][r][t][0], acc[1][r][t][0]),
                        vaddq_f32(acc[0][r][t][1], acc[1][r][t][1]),
                    ]
                } else {
                    acc[0][r][t]
                };
                let mut v = arm::reduce8(l[0], l[1]);
                if offset {
                    v += m_sum[r][t];
                }
                if pairs && n % 2 == 1 {
                    // The unpaired last block, fused in whole.
                    let (xb, yb) = (x(r, n - 1), y(t, n - 1));
                    let q = xb.levels_neon();
                    let ya = act(yb);
                    let s = D::dot(D::dot(vdupq_n_s32(0), q[0], ya[0]), q[1], ya[1]);
                    let d = scale1(xb) * arm::f16_to_f32(yb.d);
                    v = d.mul_add(vaddvq_s32(s) as f32, v);
                }
                out[r][t] = v;
            }
        }
        out
    }
}

/// The offset chains of one block (Order::LanesOffset): `m_sum = fma(m_w, s_a, m_sum)`, with
/// the rows' blocks `x` and the activations' `s` terms.
#[inline(always)]
fn offset_step<B: Block32, const R: usize, const T: usize>(
    m_sum: &mut [[f32; T]; R],
    x: [&B; R],
    s: [[u8; 2]; T],
) {
    let s = s.map(arm::f16_to_f32);
    for (m_sum, x) in m_sum.iter_mut().zip(x) {
        let m = arm::f16_to_f32(x.offset_raw());
        for (m_sum, s) in m_sum.iter_mut().zip(s) {
            *m_sum = m.mul_add(s, *m_sum);
        }
    }
}

/// Rows `rows` of a matrix of `row_bytes`-byte rows, two at a time (`out` as
/// [`super::super::format::Kernel::dot_rows`]).
#[inline(always)]
unsafe fn rows_core<B: Block32, D: LaneDot>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    let row = |r: usize| -> &[B] { blocks(&w[r * row_bytes..(r + 1) * row_bytes]) };
    let first = rows.start;
    let mut r = rows.start;
    while r + 2 <= rows.end {
        prefetch_lines(w, r * row_bytes + PREFETCH_AHEAD, 2 * row_bytes);
        // SAFETY: the caller's (the level of `D`).
        let v = unsafe { core::<B, D, 2, 1>([row(r), row(r + 1)], [a]) };
        out[r - first] = v[0][0];
        out[r + 1 - first] = v[1][0];
        r += 2;
    }
    if r < rows.end {
        // SAFETY: as above.
        out[r - first] = unsafe { core::<B, D, 1, 1>([row(r)], [a]) }[0][0];
    }
}

/// One row against `N` activations (`N ≤ 4`).
#[inline(always)]
unsafe fn group_core<B: Block32, D: LaneDot, const N: usize>(w: &[B], a: [&Q8Act; N]) -> [f32; N] {
    // SAFETY: the caller's.
    unsafe { core::<B, D, 1, N>([w], a)[0] }
}

/// [`super::dot_scalar`] with base Advanced SIMD.
///
/// # Safety
/// None beyond aarch64 (every aarch64 core has Advanced SIMD).
pub(crate) unsafe fn dot_neon<B: Block32>(w: &[B], a: &Q8Act) -> f32 {
    // SAFETY: base Advanced SIMD.
    unsafe { core::<B, Widen, 1, 1>([w], [a])[0][0] }
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
    unsafe { core::<B, Sdot, 1, 1>([w], [a])[0][0] }
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
    /// bit `i` of `qh` (values 0–15, 16–31). Table loads through general registers: no
    /// vector shuffles.
    #[inline(always)]
    pub fn fifth_bits(qh: [u8; 4], spread: &[u64; 256]) -> [uint8x16_t; 2] {
        let v = qh.map(|b| spread[b as usize]);
        // SAFETY: base Advanced SIMD, register-only.
        unsafe {
            [
                vcombine_u8(vcreate_u8(v[0]), vcreate_u8(v[1])),
                vcombine_u8(vcreate_u8(v[2]), vcreate_u8(v[3])),
            ]
        }
    }
}
