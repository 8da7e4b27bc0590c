//! Q8_0's aarch64 kernels: the one-token dot (several rows at a time), the grouped (one row,
//! up to 4 tokens) and the wide (rows × up to 16 tokens, 6 a pass) prefill dots at the NEON
//! and dotprod levels, and the activation quantizer.
//!
//! Why this shape: the scalar order (module header of `q8_0.rs`) keeps 8 float lanes per dot,
//! lane `k` taking block `b`'s exact sum of values `4k .. 4k + 4` in one fused multiply-add
//! with `d_w·d_a`. `sdot` yields exactly those 4-value sums (lanes 0–3 from a block's first 16
//! bytes, 4–7 from its last 16), so the lanes are two vectors and each block is two `sdot`s and
//! two `fmla`s per (row, token). Without dotprod the sums come from widening multiplies and
//! pairwise adds. (`smmla` sums 8 values: it cannot keep the 4-value lanes.)
//!
//! What makes it fast on Neoverse-class cores, where the two (N2) or four (V1) vector pipes
//! are the limit (prices with llvm-mca: `docs/kernels.md`):
//! - The i32 → f32 conversion is not `scvtf` (two µops on pipe V0 only there) but a
//!   subtraction: each block's sums start from the bits of 1.5 · 2^23 instead of 0 (loaded,
//!   so the start takes a load pipe, not a vector one), so the sum `s` (|s| ≤ 4 · 128 · 127 <
//!   2^22) leaves the float 1.5 · 2^23 + s, and `fsub` of 1.5 · 2^23 gives `s` exactly.
//! - Four blocks' `d_w·d_a` are one vector product (the weights' four f16 scales gathered in a
//!   general register and widened by one `fcvtl`, or once per row for the wide kernel; the
//!   activation's scales stored as f32 when it was prepared), which the `fmla`s read by lane.
//! - Each lane is a chain of one fused multiply-add per block (4 cycles on those cores), so a
//!   lone row waits on it: the one-token product takes 4 rows at a time, sharing each
//!   activation load; the prefill kernels have one chain pair per token.
//! - A (row, token) pair's block is one piece of assembly (loads, `sdot`s, `fsub`s, `fmla`s):
//!   left to itself the compiler hoisted every `sdot` of a step and spilled their sums.
//!
//! Every value is the scalar's, so the bits are too.

use super::super::format::{prefetch_lines, Activation, Dotprod, Kernel, Neon, PREFETCH_AHEAD};
use super::super::neon::{f16_to_f32, f16x4_to_f32, f32x4_to_f16, reduce8};
use super::super::{blocks, ActBuf, WIDE};
use super::{quantize_activations_scalar, ActQ8_0, BlockQ8_0, Q8Act, Q8_0, QK};
use std::arch::aarch64::*;
use std::arch::asm;
use std::ops::Range;

/// The bits of [`MAGIC`] in every lane: an i32 lane holding them plus an exact sum `s` with
/// |s| < 2^22 reads, as an f32, exactly `MAGIC + s` (floats in [2^23, 2^24) are 1 apart).
/// Loaded, not moved, into each block's fresh sums: a load takes a load pipe where a vector
/// move would take one of the vector pipes this loop is bound by.
static MAGIC_BITS: [i32; 4] = [0x4B40_0000; 4];
/// 1.5 · 2^23.
const MAGIC: f32 = 12_582_912.0;

/// Rows per step of the one-token product: each row's 8 lanes are chains of one fused
/// multiply-add per block (4 cycles each on Neoverse cores), so one row alone waits on them;
/// four rows interleaved keep the pipes busy and share each activation load.
const ROWS: usize = 4;

impl Kernel<Q8_0> for Neon {
    unsafe fn dot(w: &[BlockQ8_0], a: &Q8Act) -> f32 {
        // SAFETY: NEON is in every aarch64 core.
        let [[v]] = unsafe { dots::<false, 1, 1>([w], [a]) };
        v
    }

    unsafe fn dot_rows(w: &[u8], row_bytes: usize, rows: Range<usize>, a: &Q8Act, out: &mut [f32]) {
        // SAFETY: NEON only.
        unsafe { rows_neon(w, row_bytes, rows, a, out) }
    }

    /// Each weight block is loaded and its scale widened once for all the group's tokens.
    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ8_0], a: [&Q8Act; N]) -> [f32; N] {
        // SAFETY: NEON only.
        unsafe { group::<false, N>(w, a) }
    }
}

impl Kernel<Q8_0> for Dotprod {
    unsafe fn dot(w: &[BlockQ8_0], a: &Q8Act) -> f32 {
        // SAFETY: the caller's (the CPU has dotprod).
        unsafe { dot_sdot(w, a) }
    }

    unsafe fn dot_rows(w: &[u8], row_bytes: usize, rows: Range<usize>, a: &Q8Act, out: &mut [f32]) {
        // SAFETY: the caller's (the CPU has dotprod).
        unsafe { rows_sdot(w, row_bytes, rows, a, out) }
    }

    /// Each weight block is loaded and its scale widened once for all the group's tokens.
    const GROUPED: bool = true;

    unsafe fn dot_group<const N: usize>(w: &[BlockQ8_0], a: [&Q8Act; N]) -> [f32; N] {
        // SAFETY: the caller's (the CPU has dotprod).
        unsafe { group_sdot::<N>(w, a) }
    }

    /// Up to [`WIDE_TOKENS`] tokens a pass over each row.
    const WIDE: bool = true;

    /// From 5 tokens on one pass of 5 or more beats a group of 4 and a lone token.
    const WIDE_MIN: usize = 5;

    unsafe fn dot_wide(
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
        a: &[&ActBuf],
        out: &mut [&mut [f32]],
    ) {
        // SAFETY: the caller's (the CPU has dotprod).
        unsafe { wide_sdot(w, row_bytes, rows, a, out) }
    }
}

/// Tokens per pass of the wide kernel: 6 tokens' 12 accumulators and 6 scale vectors fit the
/// 32 vector registers beside the row's block, and their 12 pointers the general registers
/// (8 tokens spilled pointers, whose reloads took load slots), and the row's scale conversion
/// is spread over more tokens than a group's 4.
const WIDE_TOKENS: usize = 6;

/// Tokens in the next pass of the wide kernel when `left` are left: the passes as even as
/// they can be (16 tokens: 6, 5, 5, not 6, 6, 4), as passes of fewer tokens spread the row's
/// block loads over fewer of them.
fn pass_len(left: usize) -> usize {
    left.div_ceil(left.div_ceil(WIDE_TOKENS))
}

/// The wide kernel's scales, kept per thread (grown once, never shrunk).
#[derive(Default)]
struct WideScales {
    /// The current row's scales widened to f32 ([`row_scales`]).
    row: Vec<f32>,
    /// The tokens' f32 scales four blocks at a time, per pass of tokens: for the pass of
    /// tokens `t0 .. t0 + m`, from `4 · t0 · steps`, step `q`'s `m` tokens' scales of blocks
    /// `4q .. 4q + 4` one after the other, so that a pass reads them through one pointer
    /// (six tokens' own pointers left too few general registers and were reloaded from the
    /// stack, load slots the loop is short of).
    tokens: Vec<f32>,
}

thread_local! {
    static WIDE_SCALES: std::cell::RefCell<WideScales> =
        std::cell::RefCell::new(WideScales::default());
}

/// Rows `rows` against `a` (at most [`super::super::WIDE`] tokens), each row read once per
/// [`WIDE_TOKENS`] tokens and its scales widened once.
#[target_feature(enable = "dotprod")]
unsafe fn wide_sdot(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &[&ActBuf],
    out: &mut [&mut [f32]],
) {
    let n = a.len().min(out.len());
    if n == 0 {
        return;
    }
    let views: [&Q8Act; WIDE] = std::array::from_fn(|k| ActQ8_0::view(a[k.min(n - 1)]));
    let first = rows.start;
    let nb = row_bytes / std::mem::size_of::<BlockQ8_0>();
    // Four-block steps every token has (a token of another length takes single dots).
    let steps = views[..n]
        .iter()
        .fold(nb, |m, v| m.min(v.blocks.len()).min(v.d.len()))
        / 4;
    WIDE_SCALES.with(|cell| {
        let scales = &mut *cell.borrow_mut();
        let WideScales { row: dw, tokens } = scales;
        dw.resize(nb, 0.0);
        tokens.clear();
        let mut t0 = 0;
        while t0 < n {
            let m = pass_len(n - t0);
            for q in 0..steps {
                for v in &views[t0..t0 + m] {
                    tokens.extend_from_slice(&v.d[4 * q..4 * q + 4]);
                }
            }
            t0 += m;
        }
        for r in rows {
            prefetch_lines(w, (r + 1) * row_bytes, row_bytes);
            let row: &[BlockQ8_0] = blocks(&w[r * row_bytes..(r + 1) * row_bytes]);
            row_scales(row, dw);
            let mut t = 0;
            while t < n {
                let m = pass_len(n - t);
                let v = &views[t..];
                let pack = &tokens[4 * t * steps..4 * (t + m) * steps];
                let mut put = |vals: &[f32]| {
                    for (k, val) in vals.iter().enumerate() {
                        out[t + k][r - first] = *val;
                    }
                };
                let at = |k: usize| v[k];
                // One pass of `$n` tokens, the row's scales widened beforehand.
                macro_rules! pass {
                    ($n:literal) => {
                        put(&group_with::<true, $n, true>(
                            row,
                            std::array::from_fn(at),
                            dw,
                            pack,
                        ))
                    };
                }
                // SAFETY (every arm): dotprod is the caller's.
                unsafe {
                    match m {
                        6 => pass!(6),
                        5 => pass!(5),
                        4 => pass!(4),
                        3 => pass!(3),
                        2 => pass!(2),
                        _ => pass!(1),
                    }
                }
                t += m;
            }
        }
    });
}

#[target_feature(enable = "dotprod")]
unsafe fn dot_sdot(w: &[BlockQ8_0], a: &Q8Act) -> f32 {
    // SAFETY: the caller's (dotprod).
    let [[v]] = unsafe { dots::<true, 1, 1>([w], [a]) };
    v
}

#[target_feature(enable = "dotprod")]
unsafe fn group_sdot<const N: usize>(w: &[BlockQ8_0], a: [&Q8Act; N]) -> [f32; N] {
    // SAFETY: the caller's (dotprod).
    unsafe { group::<true, N>(w, a) }
}

unsafe fn rows_neon(w: &[u8], row_bytes: usize, rows: Range<usize>, a: &Q8Act, out: &mut [f32]) {
    // SAFETY: NEON only.
    unsafe { by_rows::<false>(w, row_bytes, rows, a, out) }
}

#[target_feature(enable = "dotprod")]
unsafe fn rows_sdot(w: &[u8], row_bytes: usize, rows: Range<usize>, a: &Q8Act, out: &mut [f32]) {
    // SAFETY: the caller's (dotprod).
    unsafe { by_rows::<true>(w, row_bytes, rows, a, out) }
}

/// [`Kernel::dot_rows`]: [`ROWS`] rows a step, then 2, then 1, each row prefetched as the
/// default does.
///
/// # Safety
/// With `DOT`, the CPU has dotprod.
#[inline(always)]
unsafe fn by_rows<const DOT: bool>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    let row = |r: usize| -> &[BlockQ8_0] { blocks(&w[r * row_bytes..(r + 1) * row_bytes]) };
    let (first, mut r) = (rows.start, rows.start);
    while r < rows.end {
        let n = match rows.end - r {
            n if n >= ROWS => ROWS,
            n if n >= 2 => 2,
            _ => 1,
        };
        for k in r..r + n {
            prefetch_lines(w, k * row_bytes + PREFETCH_AHEAD, row_bytes);
        }
        let o = &mut out[r - first..r - first + n];
        // SAFETY (every arm): the caller's.
        unsafe {
            match n {
                ROWS => {
                    let v = dots::<DOT, ROWS, 1>(std::array::from_fn(|k| row(r + k)), [a]);
                    for (o, [v]) in o.iter_mut().zip(v) {
                        *o = v;
                    }
                }
                2 => {
                    let v = dots::<DOT, 2, 1>([row(r), row(r + 1)], [a]);
                    for (o, [v]) in o.iter_mut().zip(v) {
                        *o = v;
                    }
                }
                _ => o[0] = dots::<DOT, 1, 1>([row(r)], [a])[0][0],
            }
        }
        r += n;
    }
}

/// `N` tokens' dots of row `w`, all at once when the tokens have the same length.
///
/// # Safety
/// With `DOT`, the CPU has dotprod.
#[inline(always)]
unsafe fn group<const DOT: bool, const N: usize>(w: &[BlockQ8_0], a: [&Q8Act; N]) -> [f32; N] {
    // SAFETY: the caller's.
    unsafe { group_with::<DOT, N, false>(w, a, &[], &[]) }
}

/// [`group`], with the row's and the tokens' scales laid out beforehand (`PRE`, as
/// [`dots_with`]).
///
/// # Safety
/// With `DOT`, the CPU has dotprod.
#[inline(always)]
unsafe fn group_with<const DOT: bool, const N: usize, const PRE: bool>(
    w: &[BlockQ8_0],
    a: [&Q8Act; N],
    dw: &[f32],
    pack: &[f32],
) -> [f32; N] {
    const { assert!(N >= 1 && N <= WIDE_TOKENS) };
    let nb = w.len().min(a[0].blocks.len());
    if a.iter().any(|a| a.blocks.len().min(w.len()) != nb) {
        // Tokens of other lengths read other block counts: their single dots (a loop, not a
        // closure, so that they stay in the caller's dotprod code).
        let mut v = [0f32; N];
        for (v, a) in v.iter_mut().zip(a) {
            // SAFETY: the caller's.
            *v = unsafe { dots::<DOT, 1, 1>([w], [a])[0][0] };
        }
        return v;
    }
    // SAFETY: the caller's.
    let [v] = unsafe { dots_with::<DOT, 1, N, PRE>([w], a, dw, pack) };
    v
}

/// One (row, token) pair's block `L` of a step: the 8 lane sums of `own` (block `L` after
/// `own`, the side not shared by the other pairs of the step, loaded here) times the other
/// side's halves `s0`, `s1`, converted exactly ([`MAGIC`]) and fused into `acc` with lane `L`
/// of `dd` (the block's `d_w·d_a`). Sums are symmetric in their two sides.
///
/// # Safety
/// Block `L` after `own` is readable; with `DOT`, the CPU has dotprod.
#[inline(always)]
unsafe fn pair<const DOT: bool, const L: i32>(
    acc: &mut [float32x4_t; 2],
    own: *const BlockQ8_0,
    s0: int8x16_t,
    s1: int8x16_t,
    dd: float32x4_t,
    magic: float32x4_t,
) {
    if DOT {
        // SAFETY: the caller's.
        unsafe { pair_sdot::<L>(acc, own, s0, s1, dd, magic) }
    } else {
        // SAFETY: the caller's (block L after `own`); register-only NEON. Products are at most
        // 128 · 127 in magnitude (activations lie in ±127), so a pair of them fits i16.
        unsafe {
            let q = (*own.add(L as usize)).qs.as_ptr();
            let base = vld1q_s32(MAGIC_BITS.as_ptr());
            let sums = |x: int8x16_t, y: int8x16_t| {
                let lo = vmull_s8(vget_low_s8(x), vget_low_s8(y));
                let hi = vmull_high_s8(x, y);
                vsubq_f32(
                    vreinterpretq_f32_s32(vpadalq_s16(base, vpaddq_s16(lo, hi))),
                    magic,
                )
            };
            let f0 = sums(vld1q_s8(q), s0);
            let f1 = sums(vld1q_s8(q.add(16)), s1);
            acc[0] = vfmaq_laneq_f32::<L>(acc[0], f0, dd);
            acc[1] = vfmaq_laneq_f32::<L>(acc[1], f1, dd);
        }
    }
}

/// [`pair`] with `sdot`, as one block of assembly: the compiler, free to schedule each
/// instruction, hoisted a whole step's `sdot`s and spilled their sums to the stack. The block
/// is addressed from the step's base with a constant offset (no address arithmetic per pair).
///
/// # Safety
/// As [`pair`], with dotprod.
#[inline]
#[target_feature(enable = "dotprod")]
unsafe fn pair_sdot<const L: i32>(
    acc: &mut [float32x4_t; 2],
    own: *const BlockQ8_0,
    s0: int8x16_t,
    s1: int8x16_t,
    dd: float32x4_t,
    magic: float32x4_t,
) {
    const { assert!(L >= 0 && L < 4 && std::mem::size_of::<BlockQ8_0>() == 34) };
    // SAFETY: reads the caller's block (its 32 bytes of `qs` at offset 2) and the 16 bytes of
    // `MAGIC_BITS`; dotprod is the caller's.
    unsafe {
        asm!(
            "ldr {a0:q}, [{init}]",
            "ldr {a1:q}, [{init}]",
            "ldur {o0:q}, [{own}, #{lo}]",
            "ldur {o1:q}, [{own}, #{hi}]",
            "sdot {a0:v}.4s, {o0:v}.16b, {s0:v}.16b",
            "sdot {a1:v}.4s, {o1:v}.16b, {s1:v}.16b",
            "fsub {a0:v}.4s, {a0:v}.4s, {m:v}.4s",
            "fsub {a1:v}.4s, {a1:v}.4s, {m:v}.4s",
            "fmla {c0:v}.4s, {a0:v}.4s, {dd:v}.s[{l}]",
            "fmla {c1:v}.4s, {a1:v}.4s, {dd:v}.s[{l}]",
            init = in(reg) MAGIC_BITS.as_ptr(),
            own = in(reg) own,
            s0 = in(vreg) s0,
            s1 = in(vreg) s1,
            m = in(vreg) magic,
            dd = in(vreg) dd,
            c0 = inout(vreg) acc[0],
            c1 = inout(vreg) acc[1],
            a0 = out(vreg) _,
            a1 = out(vreg) _,
            o0 = out(vreg) _,
            o1 = out(vreg) _,
            l = const L,
            lo = const 34 * L + 2,
            hi = const 34 * L + 18,
            options(pure, readonly, nostack, preserves_flags)
        )
    };
}

/// The f32 scales of four weight blocks: their f16 bits gathered in a general register (the
/// vector lane inserts the compiler picks instead cost a vector µop each), moved over once
/// and widened by one `fcvtl` (exact: [`super::f16_to_f32`]'s values).
#[inline(always)]
fn weight_scales4(w: *const BlockQ8_0) -> float32x4_t {
    // SAFETY: the caller's four blocks at `w` (alignment 1).
    let bits = (0..4).fold(0u64, |v, j| {
        v | (u16::from_le_bytes(unsafe { (*w.add(j)).d }) as u64) << (16 * j)
    });
    let h: uint16x4_t;
    // SAFETY: register-only base instruction.
    unsafe {
        asm!(
            "fmov {h:d}, {bits}",
            bits = in(reg) bits,
            h = lateout(vreg) h,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    f16x4_to_f32(h)
}

/// Block `b + L` of `R` rows against `N` tokens (`R == 1` or `N == 1`): every (row, token)
/// pair's [`pair`], the shared side's halves loaded once.
///
/// # Safety
/// Block `b + L` exists in every row and token; with `DOT`, the CPU has dotprod.
#[inline(always)]
unsafe fn step<const DOT: bool, const R: usize, const N: usize, const L: i32>(
    acc: &mut [[[float32x4_t; 2]; N]; R],
    w: &[*const BlockQ8_0; R],
    y: &[*const BlockQ8_0; N],
    dd: &[[float32x4_t; N]; R],
    b: usize,
    magic: float32x4_t,
) {
    const { assert!(R == 1 || N == 1) };
    let at = b + L as usize;
    // SAFETY (every access): the caller's; each `qs` is 32 bytes.
    unsafe {
        if N == 1 {
            // One token: its block is shared by the rows.
            let q = (*y[0].add(at)).qs.as_ptr();
            let (s0, s1) = (vld1q_s8(q), vld1q_s8(q.add(16)));
            for r in 0..R {
                pair::<DOT, L>(&mut acc[r][0], w[r].add(b), s0, s1, dd[r][0], magic);
            }
        } else {
            // One row: its block is shared by the tokens.
            let q = (*w[0].add(at)).qs.as_ptr();
            let (s0, s1) = (vld1q_s8(q), vld1q_s8(q.add(16)));
            for t in 0..N {
                pair::<DOT, L>(&mut acc[0][t], y[t].add(b), s0, s1, dd[0][t], magic);
            }
        }
    }
}

/// `R` rows against `N` activations (`R == 1` or `N == 1`), over the blocks all of them have:
/// per pair the scalar's 8 lanes, four blocks a step, then one at a time.
///
/// # Safety
/// With `DOT`, the CPU has dotprod.
#[inline(always)]
unsafe fn dots<const DOT: bool, const R: usize, const N: usize>(
    w: [&[BlockQ8_0]; R],
    a: [&Q8Act; N],
) -> [[f32; N]; R] {
    // SAFETY: the caller's.
    unsafe { dots_with::<DOT, R, N, false>(w, a, &[], &[]) }
}

/// [`dots`], with the row's scales already widened (`PRE`, one row: `dw[b]` is
/// `f16_to_f32(w[0][b].d)`, at least as many as the row's blocks) when the row is dotted
/// with more tokens than one call takes, so that they are widened once per row, and the
/// tokens' scales packed four blocks a step (`pack[4 · (N · q + t) + j]` is token `t`'s
/// scale of block `4q + j`; the steps it holds are taken four blocks at a time, the rest one
/// block at a time).
///
/// # Safety
/// With `DOT`, the CPU has dotprod.
#[inline(always)]
unsafe fn dots_with<const DOT: bool, const R: usize, const N: usize, const PRE: bool>(
    w: [&[BlockQ8_0]; R],
    a: [&Q8Act; N],
    dw: &[f32],
    pack: &[f32],
) -> [[f32; N]; R] {
    const { assert!(!PRE || R == 1) };
    let nb = w
        .iter()
        .map(|w| w.len())
        .chain(a.iter().map(|a| a.blocks.len().min(a.d.len())));
    let nb = nb.min().unwrap_or(0);
    let nb = if PRE { nb.min(dw.len()) } else { nb };
    // Blocks taken four at a time.
    let main = if PRE {
        (nb / 4).min(pack.len() / (4 * N)) * 4
    } else {
        nb / 4 * 4
    };
    let wp: [*const BlockQ8_0; R] = w.map(|w| w.as_ptr());
    let yp: [*const BlockQ8_0; N] = a.map(|a| a.blocks.as_ptr());
    let dp: [*const f32; N] = a.map(|a| a.d.as_ptr());
    let pre = dw.as_ptr();
    let packed = pack.as_ptr();
    // SAFETY (the whole body): every pointer is read below `nb` blocks (or scales), which all
    // the slices have, and `packed` below `N · main <= pack.len()`; the rest is register-only
    // NEON; `step`'s other contract is the caller's.
    unsafe {
        let magic = vdupq_n_f32(MAGIC);
        let mut acc = [[[vdupq_n_f32(0.0); 2]; N]; R];
        let mut b = 0;
        while b < main {
            let da: [float32x4_t; N] = std::array::from_fn(|t| {
                if PRE {
                    vld1q_f32(packed.add(N * b + 4 * t))
                } else {
                    vld1q_f32(dp[t].add(b))
                }
            });
            let dd: [[float32x4_t; N]; R] = std::array::from_fn(|r| {
                let dw = if PRE {
                    vld1q_f32(pre.add(b))
                } else {
                    weight_scales4(wp[r].add(b))
                };
                std::array::from_fn(|t| vmulq_f32(dw, da[t]))
            });
            step::<DOT, R, N, 0>(&mut acc, &wp, &yp, &dd, b, magic);
            step::<DOT, R, N, 1>(&mut acc, &wp, &yp, &dd, b, magic);
            step::<DOT, R, N, 2>(&mut acc, &wp, &yp, &dd, b, magic);
            step::<DOT, R, N, 3>(&mut acc, &wp, &yp, &dd, b, magic);
            b += 4;
        }
        while b < nb {
            let dd: [[float32x4_t; N]; R] = std::array::from_fn(|r| {
                let dw = if PRE {
                    *pre.add(b)
                } else {
                    f16_to_f32((*wp[r].add(b)).d)
                };
                std::array::from_fn(|t| vdupq_n_f32(dw * *dp[t].add(b)))
            });
            step::<DOT, R, N, 0>(&mut acc, &wp, &yp, &dd, b, magic);
            b += 1;
        }
        acc.map(|row| row.map(|[lo, hi]| reduce8(lo, hi)))
    }
}

/// `dw[b] = f16_to_f32(w[b].d)` for every block of `w` (`dw` as long), four at a time.
fn row_scales(w: &[BlockQ8_0], dw: &mut [f32]) {
    let mut b = 0;
    while b + 4 <= w.len().min(dw.len()) {
        // SAFETY: blocks b .. b + 4 of `w`; 4 floats at b of `dw`.
        unsafe { vst1q_f32(dw.as_mut_ptr().add(b), weight_scales4(w.as_ptr().add(b))) };
        b += 4;
    }
    for (d, x) in dw[b..].iter_mut().zip(&w[b..]) {
        *d = f16_to_f32(x.d);
    }
}

/// [`super::quantize_activations`] with NEON, the same bytes: the absmax by `fmax` (a block
/// holding a NaN, which `fmax` passes on, is left to the scalar code, whose maximum skips it),
/// the same product `v · (127 / absmax)`, rounded to nearest even by `fcvtns` (the scalar's
/// `nearest_int` for every input, NaN giving 0 and large values saturating alike), and
/// narrowed with saturation, then clamped at −127.
pub(super) fn quantize_activations(src: &[f32], dst: &mut [BlockQ8_0], d_f32: &mut [f32]) {
    for ((x, b), d) in src
        .chunks_exact(QK)
        .zip(dst.iter_mut())
        .zip(d_f32.iter_mut())
    {
        // SAFETY: 8 loads of 4 floats inside the 32 of `x`, 2 stores of 16 bytes inside the 32
        // of `b.qs`; the rest is register-only NEON.
        unsafe {
            let v: [float32x4_t; 8] = std::array::from_fn(|j| vld1q_f32(x.as_ptr().add(4 * j)));
            let m: [float32x4_t; 4] =
                std::array::from_fn(|j| vmaxq_f32(vabsq_f32(v[2 * j]), vabsq_f32(v[2 * j + 1])));
            let amax = vmaxvq_f32(vmaxq_f32(vmaxq_f32(m[0], m[1]), vmaxq_f32(m[2], m[3])));
            if amax.is_nan() {
                quantize_activations_scalar(x, std::slice::from_mut(b), std::slice::from_mut(d));
                continue;
            }
            let id = vdupq_n_f32(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            let q: [int32x4_t; 8] = std::array::from_fn(|j| vcvtnq_s32_f32(vmulq_f32(v[j], id)));
            let h: [int16x8_t; 4] =
                std::array::from_fn(|j| vqmovn_high_s32(vqmovn_s32(q[2 * j]), q[2 * j + 1]));
            let lo = vmaxq_s8(vqmovn_high_s16(vqmovn_s16(h[0]), h[1]), vdupq_n_s8(-127));
            let hi = vmaxq_s8(vqmovn_high_s16(vqmovn_s16(h[2]), h[3]), vdupq_n_s8(-127));
            vst1q_s8(b.qs.as_mut_ptr(), lo);
            vst1q_s8(b.qs.as_mut_ptr().add(16), hi);
            *d = amax / 127.0;
            // `fcvtn`: `f32_to_f16`'s bits for every value but NaN, which `d` is not.
            b.d = vget_lane_u16::<0>(f32x4_to_f16(vdupq_n_f32(*d))).to_le_bytes();
        }
    }
}

/// Σ qs of a block (exact: at most 32 · 128 in magnitude).
#[inline(always)]
pub(super) fn block_sum(b: &BlockQ8_0) -> i32 {
    // SAFETY: two 16-byte loads inside the 32 of `qs`; register-only NEON.
    unsafe {
        let lo = vld1q_s8(b.qs.as_ptr());
        let hi = vld1q_s8(b.qs.as_ptr().add(16));
        vaddlvq_s16(vaddq_s16(vpaddlq_s8(lo), vpaddlq_s8(hi)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::testutil::values;
    use super::*;

    /// The NEON activation quantizer writes the scalar's bytes and scales, on random blocks at
    /// many scales and on edge blocks: zeros, ties, infinities, NaNs, denormals, ±f32::MAX.
    #[test]
    fn neon_activation_quantizer_writes_the_scalar_bytes() {
        let mut blocks: Vec<Vec<f32>> = Vec::new();
        for (seed, scale) in [(1u64, 1.0f32), (2, 1e-3), (3, 1e3), (4, 1e-38), (5, 1e37)] {
            for i in 0..16 {
                blocks.push(values(seed * 100 + i, QK, scale));
            }
        }
        blocks.push(vec![0.0; QK]);
        blocks.push(
            (0..QK)
                .map(|i| if i % 3 == 0 { -0.0 } else { 0.0 })
                .collect(),
        );
        blocks.push((0..QK).map(|i| i as f32 - 15.5).collect());
        let mut ties: Vec<f32> = (0..QK).map(|i| (i as f32 - 16.0) * 0.5).collect();
        ties[0] = 127.0;
        blocks.push(ties);
        blocks.push((0..QK).map(|i| f32::from_bits(i as u32 % 5)).collect());
        for special in [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            -f32::MAX,
        ] {
            for at in [0usize, 13, 31] {
                let mut x = values(10 + at as u64, QK, 2.0);
                x[at] = special;
                blocks.push(x);
            }
        }
        blocks.push(vec![f32::NAN; QK]);
        let all = blocks.concat();
        let n = all.len() / QK;
        let (mut want, mut got) = (vec![BlockQ8_0::ZERO; n], vec![BlockQ8_0::ZERO; n]);
        let (mut want_d, mut got_d) = (vec![0f32; n], vec![0f32; n]);
        quantize_activations_scalar(&all, &mut want, &mut want_d);
        quantize_activations(&all, &mut got, &mut got_d);
        for i in 0..n {
            assert_eq!(want[i], got[i], "block {i}: {:?}", &all[QK * i..QK * i + 4]);
            assert_eq!(want_d[i].to_bits(), got_d[i].to_bits(), "block {i}");
            assert_eq!(
                block_sum(&got[i]),
                got[i].qs.iter().map(|&q| q as i32).sum::<i32>()
            );
        }
    }
}
