//! aarch64 kernels of Q4_0: the scalar's one fused chain per row (`acc = fma(sum, d_w·d_a,
//! acc)` block after block), with the exact block sums from `sdot` (or, without FEAT_DotProd,
//! `smull` + `addp` + `sadalp`).
//!
//! Why this shape: the chain is one dependent fused multiply-add per block, so one row alone
//! is bound by its latency. [`rows`] therefore puts 4 rows in the 4 lanes of one accumulator
//! (each lane still takes exactly one fused step per block, in block order: the bits of
//! [`dot`]); [`group`] puts up to 4 tokens in the lanes; with i8mm, [`wide`] takes 2 rows × 2
//! tokens per `smmla` (8-value dots: Q4_0 sums each block whole, so any split of the 32
//! products is exact). Block sums are `Σ q·a − 8·Σ a` (the second term prepared once per
//! activation, [`Q8Act::sums`]) where the weights are not shared, and `Σ (q − 8)·a` where they
//! are (grouped, wide).
//!
//! Block sums as floats without `scvtf` (two µops on one pipe of Neoverse N2 and V1): where
//! the sums of 4 rows or 4 tokens end up side by side, each starts from a fresh register
//! loaded with `MAGIC` (1.5 · 2^23; for the rows, `MAGIC − 8·Σ a`) in one lane, so the
//! lanes' totals read as floats are `MAGIC + sum` and one `fsub` converts them; a load, not
//! a vector `mov`, because the vector pipes are the bound. The one-row chain ([`dot_core`])
//! runs its sums on over the blocks instead (wrapping; a block's sum is the difference of two
//! running sums, exact in i32).

use super::super::block32::neon::{f16x4, LaneDot, Sdot, Widen};
use super::super::format::{prefetch_lines, PREFETCH_AHEAD};
use super::super::neon as arm;
use super::super::q8_0::{BlockQ8_0, Q8Act};
use super::super::{blocks, ActBuf};
use super::{BlockQ4_0, QK};
use std::arch::aarch64::*;
use std::ops::Range;

/// The 32 nibbles of a block: values 0–15 and 16–31, unsigned.
#[inline(always)]
fn nibbles(x: &BlockQ4_0) -> [int8x16_t; 2] {
    // SAFETY: 16 bytes; base Advanced SIMD.
    unsafe {
        let v = vld1q_u8(x.qs.as_ptr());
        [
            vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))),
            vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)),
        ]
    }
}

/// The levels `q − 8` of a block (signed).
#[inline(always)]
fn levels(x: &BlockQ4_0) -> [int8x16_t; 2] {
    let q = nibbles(x);
    // SAFETY: base Advanced SIMD, register-only.
    unsafe { q.map(|v| vsubq_s8(v, vdupq_n_s8(8))) }
}

/// The 32 activation bytes of a block.
#[inline(always)]
fn act(y: &BlockQ8_0) -> [int8x16_t; 2] {
    let p = y.qs.as_ptr();
    // SAFETY: 32 bytes of qs; base Advanced SIMD.
    unsafe { [vld1q_s8(p), vld1q_s8(p.add(16))] }
}

/// `acc + Σ q·y` over the block's 32 values, in 4 lanes (running sum, wrapping).
#[inline(always)]
unsafe fn block_dot<D: LaneDot>(acc: int32x4_t, q: [int8x16_t; 2], y: [int8x16_t; 2]) -> int32x4_t {
    // SAFETY: the caller's (the level of `D`).
    unsafe { D::dot(D::dot(acc, q[0], y[0]), q[1], y[1]) }
}

/// Lane `k` = the sum of the 4 lanes of `v[k]` (the rows' or tokens' running sums side by side).
#[inline(always)]
fn lane_totals(v: [int32x4_t; 4]) -> int32x4_t {
    // SAFETY: base Advanced SIMD, register-only.
    unsafe { vpaddq_s32(vpaddq_s32(v[0], v[1]), vpaddq_s32(v[2], v[3])) }
}

/// One row's exact block sum `Σ (q − 8)·a` (the tails).
#[inline(always)]
unsafe fn block_sum<D: LaneDot>(x: &BlockQ4_0, y: &BlockQ8_0) -> i32 {
    // SAFETY: the caller's.
    unsafe { vaddvq_s32(block_dot::<D>(vdupq_n_s32(0), levels(x), act(y))) }
}

/// One block's step of the scalar chain.
#[inline(always)]
fn step(acc: f32, sum: i32, d_w: [u8; 2], d_a: [u8; 2]) -> f32 {
    (sum as f32).mul_add(arm::f16_to_f32(d_w) * arm::f16_to_f32(d_a), acc)
}

/// 1.5 · 2^23 as f32 bits: an integer `v` with `|v| < 2^22` added to these bits reads as the
/// float `MAGIC + v` exactly, so `(MAGIC + v) − MAGIC` converts it in one `fsub` (`scvtf` is two
/// µops on one pipe of Neoverse N2 and V1). Every block sum here is below 2^17.
const MAGIC: i32 = 0x4B40_0000;
/// [`MAGIC`] in every lane, in memory (the `smmla` steps load a fresh copy of it).
static MAGIC4: [i32; 4] = [MAGIC; 4];

/// Block sums (integers, lanes) as floats: `bits − MAGIC` for `bits = MAGIC + sum`.
#[inline(always)]
fn from_magic(bits: int32x4_t) -> float32x4_t {
    // SAFETY: base Advanced SIMD, register-only.
    unsafe {
        vsubq_f32(
            vreinterpretq_f32_s32(bits),
            vreinterpretq_f32_s32(vdupq_n_s32(MAGIC)),
        )
    }
}

/// [`super::dot_scalar`]: four blocks a step, their sums side by side in one vector, then the
/// four fused steps of the chain in order.
#[inline(always)]
unsafe fn dot_core<D: LaneDot>(w: &[BlockQ4_0], a: &Q8Act) -> f32 {
    let n = w.len().min(a.blocks.len());
    let full = if a.sums.len() >= n { n / 4 * 4 } else { 0 };
    let (x, y) = (w.as_ptr(), a.blocks.as_ptr());
    let mut acc = 0f32;
    // SAFETY (the whole body): the caller's (the level of `D`); block indices are below `n`
    // (the sums' below `full`).
    unsafe {
        let mut run = [vdupq_n_s32(0); 4];
        let mut prev = vdupq_n_s32(0);
        let mut b = 0;
        while b < full {
            for (k, r) in run.iter_mut().enumerate() {
                *r = block_dot::<D>(*r, nibbles(&*x.add(b + k)), act(&*y.add(b + k)));
            }
            let t = lane_totals(run);
            let sums = vld1q_s32(a.sums.as_ptr().add(b));
            let s = vsubq_s32(vsubq_s32(t, prev), vshlq_n_s32::<3>(sums));
            prev = t;
            let f = vcvtq_f32_s32(s);
            let d = vmulq_f32(
                f16x4(std::array::from_fn(|k| (*x.add(b + k)).d)),
                f16x4(std::array::from_fn(|k| (*y.add(b + k)).d)),
            );
            acc = vfmas_laneq_f32::<0>(acc, vgetq_lane_f32::<0>(f), d);
            acc = vfmas_laneq_f32::<1>(acc, vgetq_lane_f32::<1>(f), d);
            acc = vfmas_laneq_f32::<2>(acc, vgetq_lane_f32::<2>(f), d);
            acc = vfmas_laneq_f32::<3>(acc, vgetq_lane_f32::<3>(f), d);
            b += 4;
        }
        for i in b..n {
            let (x, y) = (&*x.add(i), &*y.add(i));
            acc = step(acc, block_sum::<D>(x, y), x.d, y.d);
        }
    }
    acc
}

/// Four rows (row `r` in lane `r`; the same bits as [`dot_core`] on each). Each row's block
/// sum starts from a fresh `[c_b, 0, 0, 0]`, `c_b = MAGIC − 8·Σ a` ([`starts`]), so the
/// lanes' totals (one `addp` tree for the 4 rows) are `MAGIC + Σ (q − 8)·a` for
/// [`from_magic`]: per block and row 2 `sdot` + the nibbles' `and` and `ushr`, and per block
/// for the 4 rows 3 `addp`, the conversion, the scales and the fused step.
#[inline(always)]
unsafe fn rows4_core<D: LaneDot>(w: [&[BlockQ4_0]; 4], a: &Q8Act, c: &[i32]) -> [f32; 4] {
    let n = w
        .iter()
        .fold(a.blocks.len().min(a.d.len()).min(c.len()), |n, r| {
            n.min(r.len())
        });
    let (wp, y, dp, cp) = (
        w.map(|r| r.as_ptr()),
        a.blocks.as_ptr(),
        a.d.as_ptr(),
        c.as_ptr(),
    );
    let mut out = [0f32; 4];
    // SAFETY (the whole body): the caller's (the level of `D`); block indices are below `n`.
    unsafe {
        let x = |r: usize, i: usize| -> &BlockQ4_0 { &*wp[r].add(i) };
        let mut acc = vdupq_n_f32(0.0);
        let mut b = 0;
        macro_rules! step {
            ($i:expr, $k:literal, $da:expr) => {{
                let i = $i;
                let ya = act(&*y.add(i));
                let s: [int32x4_t; 4] =
                    std::array::from_fn(|r| D::dot32_from(cp.add(i), nibbles(x(r, i)), ya));
                let dw = f16x4(std::array::from_fn(|r| x(r, i).d));
                acc = vfmaq_f32(
                    acc,
                    from_magic(lane_totals(s)),
                    vmulq_laneq_f32::<$k>(dw, $da),
                );
            }};
        }
        while b + 4 <= n {
            let da = vld1q_f32(dp.add(b));
            step!(b, 0, da);
            step!(b + 1, 1, da);
            step!(b + 2, 2, da);
            step!(b + 3, 3, da);
            b += 4;
        }
        while b < n {
            let da = vdupq_n_f32(*dp.add(b));
            step!(b, 0, da);
            b += 1;
        }
        vst1q_f32(out.as_mut_ptr(), acc);
    }
    out
}

thread_local! {
    /// [`starts`] of the current activation.
    static STARTS: std::cell::RefCell<Vec<i32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `MAGIC − 8·Σ a` of every block of `a` into `c`: where [`rows4_core`]'s block sums start.
fn starts(a: &Q8Act, c: &mut Vec<i32>) {
    c.clear();
    c.extend(a.sums.iter().take(a.blocks.len()).map(|&s| MAGIC - 8 * s));
}

/// Rows `rows` (as [`super::super::format::Kernel::dot_rows`]): four at a time, the rest one by one.
#[inline(always)]
unsafe fn rows_core<D: LaneDot>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    let row = |r: usize| -> &[BlockQ4_0] { blocks(&w[r * row_bytes..(r + 1) * row_bytes]) };
    let first = rows.start;
    let mut r = rows.start;
    if rows.len() >= 4 && a.sums.len() >= a.blocks.len() {
        // The buffer taken out of the thread-local and put back after: the loop stays in
        // this function (a closure has no target features, so the `sdot` wrappers, which
        // need FEAT_DotProd, would not be inlined into it).
        let mut c = STARTS.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
        starts(a, &mut c);
        while r + 4 <= rows.end {
            prefetch_lines(w, r * row_bytes + PREFETCH_AHEAD, 4 * row_bytes);
            // SAFETY: the caller's (the level of `D`).
            let v = unsafe { rows4_core::<D>([row(r), row(r + 1), row(r + 2), row(r + 3)], a, &c) };
            out[r - first..r - first + 4].copy_from_slice(&v);
            r += 4;
        }
        STARTS.with(|cell| *cell.borrow_mut() = c);
    }
    for r in r..rows.end {
        prefetch_lines(w, r * row_bytes + PREFETCH_AHEAD, row_bytes);
        // SAFETY: as above.
        out[r - first] = unsafe { dot_core::<D>(row(r), a) };
    }
}

/// One row against `N ≤ 4` tokens, token `t` in lane `t` (signed levels, unpacked once; each
/// token's block sum from a fresh `[MAGIC, 0, 0, 0]`, so the lanes' totals need no more than
/// [`from_magic`]).
#[inline(always)]
unsafe fn group_core<D: LaneDot, const N: usize>(w: &[BlockQ4_0], a: [&Q8Act; N]) -> [f32; N] {
    let n = a.iter().fold(w.len(), |n, a| n.min(a.blocks.len()));
    let yp = a.map(|a| a.blocks.as_ptr());
    let mut out = [0f32; 4];
    // SAFETY (the whole body): the caller's (the level of `D`); block indices are below `n`.
    unsafe {
        let mut acc = vdupq_n_f32(0.0);
        for (i, x) in w[..n].iter().enumerate() {
            let q = levels(x);
            let y: [&BlockQ8_0; N] = std::array::from_fn(|t| &*yp[t].add(i));
            // Each token's sum from a fresh `[MAGIC, 0, 0, 0]`: the totals are `MAGIC + sum`.
            let s: [int32x4_t; 4] = std::array::from_fn(|t| {
                if t < N {
                    D::dot32_from(&MAGIC, q, act(y[t]))
                } else {
                    vdupq_n_s32(0)
                }
            });
            let da = f16x4(std::array::from_fn(|t| if t < N { y[t].d } else { [0; 2] }));
            let d = vmulq_n_f32(da, arm::f16_to_f32(x.d));
            acc = vfmaq_f32(acc, from_magic(lane_totals(s)), d);
        }
        vst1q_f32(out.as_mut_ptr(), acc);
    }
    std::array::from_fn(|t| out[t])
}

/// [`super::dot_scalar`] with base Advanced SIMD.
///
/// # Safety
/// None beyond aarch64.
pub(super) unsafe fn dot_neon(w: &[BlockQ4_0], a: &Q8Act) -> f32 {
    // SAFETY: base Advanced SIMD.
    unsafe { dot_core::<Widen>(w, a) }
}

/// [`rows_core`] with base Advanced SIMD.
///
/// # Safety
/// `rows` lie inside `w`; `out.len() == rows.len()`.
pub(super) unsafe fn rows_neon(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    // SAFETY: the caller's.
    unsafe { rows_core::<Widen>(w, row_bytes, rows, a, out) }
}

/// [`group_core`] with base Advanced SIMD.
///
/// # Safety
/// None beyond aarch64.
pub(super) unsafe fn group_neon<const N: usize>(w: &[BlockQ4_0], a: [&Q8Act; N]) -> [f32; N] {
    // SAFETY: the caller's.
    unsafe { group_core::<Widen, N>(w, a) }
}

/// [`dot_neon`] with `sdot`.
///
/// # Safety
/// The CPU has FEAT_DotProd.
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn dot_dotprod(w: &[BlockQ4_0], a: &Q8Act) -> f32 {
    // SAFETY: the caller's.
    unsafe { dot_core::<Sdot>(w, a) }
}

/// [`rows_neon`] with `sdot`.
///
/// # Safety
/// As [`dot_dotprod`] and [`rows_neon`].
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn rows_dotprod(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    a: &Q8Act,
    out: &mut [f32],
) {
    // SAFETY: the caller's.
    unsafe { rows_core::<Sdot>(w, row_bytes, rows, a, out) }
}

/// [`group_neon`] with `sdot`.
///
/// # Safety
/// As [`dot_dotprod`].
#[target_feature(enable = "dotprod")]
pub(super) unsafe fn group_dotprod<const N: usize>(w: &[BlockQ4_0], a: [&Q8Act; N]) -> [f32; N] {
    // SAFETY: the caller's.
    unsafe { group_core::<Sdot, N>(w, a) }
}

/// Pairs of rows against pairs of tokens with `smmla` (i8mm): each `smmla` takes 8 values of
/// 2 rows and of 2 tokens and leaves the 4 (row, token) dots, so the 4 lanes of one
/// accumulator are 4 chains, each one fused step per block in block order (the bits of
/// [`dot_core`]). Each row pair's block is unpacked once for all the token pairs.
///
/// The token pairs are packed once per batch of tokens and kept per thread ([`PackRing`],
/// keyed by the tokens' stamps, as the K-quants' lanes): a product's row bands after the
/// first reuse them. Per row pair, block and token pair the work is 4 `smmla` into a fresh
/// `MAGIC` (a load), one `fsub` converting the 4 sums, one `fmul` for the 4 scales
/// `d_w · d_a` and the 4 chains' fused step: 7 vector instructions for 4 (row, token) blocks.
mod mm {
    use super::super::super::q8_k::PackRing;
    use super::*;

    /// A token pair's block: the 4 vectors `smmla` takes (values 8c..8c+8 of token 0, then of
    /// token 1, for c = 0..4) and `[d_0, d_1, d_0, d_1]`.
    #[derive(Copy, Clone)]
    #[repr(C)]
    pub(super) struct PairBlock {
        q: [int8x16_t; 4],
        d: float32x4_t,
    }

    /// A batch of tokens packed in pairs, block-major (`blocks[i · pairs + p]`; a last pair
    /// of one token holds it twice), and what it holds: the tokens' stamps and the block count.
    #[derive(Default)]
    pub(super) struct Packed {
        blocks: Vec<PairBlock>,
        pairs: usize,
        key: (Vec<u64>, usize),
    }

    impl Packed {
        fn holds(&self, acts: &[&ActBuf], nb: usize) -> bool {
            self.key.1 == nb
                && self.key.0.len() == acts.len()
                && self.key.0.iter().zip(acts).all(|(s, a)| *s == a.stamp())
        }

        /// Packs the first `nb` blocks of `views` (the tokens of `acts`, at least `nb` blocks
        /// each).
        fn pack(&mut self, acts: &[&ActBuf], views: &[&Q8Act], nb: usize) {
            self.key.0.clear();
            self.key.0.extend(acts.iter().map(|a| a.stamp()));
            self.key.1 = nb;
            let pairs = views.len().div_ceil(2);
            self.pairs = pairs;
            self.blocks.clear();
            self.blocks.reserve(nb * pairs);
            for i in 0..nb {
                for p in 0..pairs {
                    let t1 = (2 * p + 1).min(views.len() - 1);
                    self.blocks.push(pack(views[2 * p], views[t1], i));
                }
            }
        }
    }

    thread_local! {
        /// The last packings of this thread (the oldest replaced first).
        static PACKED: std::cell::RefCell<PackRing<Packed>> =
            std::cell::RefCell::new(PackRing::default());
    }

    /// `[u.d[0], v.d[0]]` and `[u.d[1], v.d[1]]`.
    #[inline(always)]
    fn zip(u: int8x16_t, v: int8x16_t) -> [int8x16_t; 2] {
        // SAFETY: base Advanced SIMD, register-only.
        unsafe {
            let (u, v) = (vreinterpretq_s64_s8(u), vreinterpretq_s64_s8(v));
            [
                vreinterpretq_s8_s64(vzip1q_s64(u, v)),
                vreinterpretq_s8_s64(vzip2q_s64(u, v)),
            ]
        }
    }

    /// Block `i` of tokens `a0` and `a1` packed.
    fn pack(a0: &Q8Act, a1: &Q8Act, i: usize) -> PairBlock {
        let (y0, y1) = (&a0.blocks[i], &a1.blocks[i]);
        let (q0, q1) = (act(y0), act(y1));
        let (lo, hi) = (zip(q0[0], q1[0]), zip(q0[1], q1[1]));
        let d = [y0.d, y1.d, y0.d, y1.d].map(arm::f16_to_f32);
        PairBlock {
            q: [lo[0], lo[1], hi[0], hi[1]],
            // SAFETY: 4 floats; base Advanced SIMD.
            d: unsafe { vld1q_f32(d.as_ptr()) },
        }
    }

    /// One row pair's block (levels `q`, scales `dw = [d_r0, d_r0, d_r1, d_r1]`) against one
    /// packed token pair: `acc + (Σ q·a) · (dw · d_a)`, fused, per lane. Written as one piece
    /// of assembly for the reason [`super::super::super::block32::neon`] gives (given separate
    /// operations the compiler hoists the products and spills them): load the pair's 4
    /// vectors and scales, `MAGIC` into a fresh register, 4 `smmla`, `fsub` of `MAGIC` (exact:
    /// |block sum| ≤ 32 · 8 · 128 < 2^22), `fmul` of the scales, `fmla`.
    #[target_feature(enable = "i8mm,dotprod")]
    #[inline]
    unsafe fn pair_step(
        acc: float32x4_t,
        q: &[int8x16_t; 4],
        dw: float32x4_t,
        magic: float32x4_t,
        pb: *const PairBlock,
    ) -> float32x4_t {
        let mut acc = acc;
        // SAFETY: `pb` points at a PairBlock (80 bytes: 4 vectors, then the scales), and
        // MAGIC4 at 16 bytes; register-only instructions of features this function requires.
        unsafe {
            std::arch::asm!(
                "ldp {a0:q}, {a1:q}, [{pb}]",
                "ldr {s:q}, [{m}]",
                "ldp {a2:q}, {a3:q}, [{pb}, #32]",
                "smmla {s:v}.4s, {q0:v}.16b, {a0:v}.16b",
                "ldr {da:q}, [{pb}, #64]",
                "smmla {s:v}.4s, {q1:v}.16b, {a1:v}.16b",
                "smmla {s:v}.4s, {q2:v}.16b, {a2:v}.16b",
                "smmla {s:v}.4s, {q3:v}.16b, {a3:v}.16b",
                "fmul {da:v}.4s, {da:v}.4s, {dw:v}.4s",
                "fsub {s:v}.4s, {s:v}.4s, {magic:v}.4s",
                "fmla {acc:v}.4s, {s:v}.4s, {da:v}.4s",
                pb = in(reg) pb,
                m = in(reg) MAGIC4.as_ptr(),
                a0 = out(vreg) _,
                a1 = out(vreg) _,
                a2 = out(vreg) _,
                a3 = out(vreg) _,
                s = out(vreg) _,
                da = out(vreg) _,
                q0 = in(vreg) q[0],
                q1 = in(vreg) q[1],
                q2 = in(vreg) q[2],
                q3 = in(vreg) q[3],
                dw = in(vreg) dw,
                magic = in(vreg) magic,
                acc = inout(vreg) acc,
                options(nostack, readonly, preserves_flags)
            )
        };
        acc
    }

    /// Two rows against `P` packed token pairs: lane `[r0·t0, r0·t1, r1·t0, r1·t1]` per pair.
    #[target_feature(enable = "i8mm,dotprod")]
    #[inline]
    unsafe fn rows2<const P: usize>(
        w: [&[BlockQ4_0]; 2],
        packed: &[PairBlock],
    ) -> [float32x4_t; P] {
        let nb = w[0].len().min(w[1].len()).min(packed.len() / P);
        // SAFETY (the whole body): i8mm is present (this function's contract); block indices
        // are below `nb`, pair blocks below `nb · P`.
        unsafe {
            let (x0, x1, pk) = (w[0].as_ptr(), w[1].as_ptr(), packed.as_ptr());
            let magic = vreinterpretq_f32_s32(vdupq_n_s32(MAGIC));
            let mut acc = [vdupq_n_f32(0.0); P];
            let (m4, eight) = (vdupq_n_u8(0x0F), vdupq_n_s8(8));
            for i in 0..nb {
                let (r0, r1) = (&*x0.add(i), &*x1.add(i));
                let z = zip(
                    vreinterpretq_s8_u8(vld1q_u8(r0.qs.as_ptr())),
                    vreinterpretq_s8_u8(vld1q_u8(r1.qs.as_ptr())),
                )
                .map(|v| vreinterpretq_u8_s8(v));
                let lv = |v: uint8x16_t| vsubq_s8(vreinterpretq_s8_u8(v), eight);
                let q = [
                    lv(vandq_u8(z[0], m4)),
                    lv(vandq_u8(z[1], m4)),
                    lv(vshrq_n_u8::<4>(z[0])),
                    lv(vshrq_n_u8::<4>(z[1])),
                ];
                let dw = f16x4([r0.d, r0.d, r1.d, r1.d]);
                for (p, acc) in acc.iter_mut().enumerate() {
                    *acc = pair_step(*acc, &q, dw, magic, pk.add(i * P + p));
                }
            }
            acc
        }
    }

    /// [`rows2`] over rows `rows` for `P` token pairs (the last pair may hold one token twice).
    #[target_feature(enable = "i8mm,dotprod")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows_pairs<const P: usize>(
        w: &[u8],
        row_bytes: usize,
        nb: usize,
        rows: Range<usize>,
        views: &[&Q8Act],
        packed: &[PairBlock],
        out: &mut [&mut [f32]],
    ) {
        let row =
            |r: usize| -> &[BlockQ4_0] { &blocks(&w[r * row_bytes..(r + 1) * row_bytes])[..nb] };
        let first = rows.start;
        let mut r = rows.start;
        while r + 2 <= rows.end {
            prefetch_lines(w, r * row_bytes + PREFETCH_AHEAD, 2 * row_bytes);
            // SAFETY: i8mm is present (this function's contract).
            let v = unsafe { rows2::<P>([row(r), row(r + 1)], packed) };
            for (p, v) in v.iter().enumerate() {
                let mut l = [0f32; 4];
                // SAFETY: 4 floats.
                unsafe { vst1q_f32(l.as_mut_ptr(), *v) };
                out[2 * p][r - first] = l[0];
                out[2 * p][r + 1 - first] = l[2];
                if 2 * p + 1 < views.len() {
                    out[2 * p + 1][r - first] = l[1];
                    out[2 * p + 1][r + 1 - first] = l[3];
                }
            }
            r += 2;
        }
        if r < rows.end {
            // The last of an odd number of rows: its tokens four at a time in lanes.
            for (g, v) in views.chunks(4).enumerate() {
                let t = 4 * g;
                // SAFETY (every arm): dotprod is present (this function's contract).
                let got: [f32; 4] = unsafe {
                    match *v {
                        [a] => [group_core::<Sdot, 1>(row(r), [a])[0], 0.0, 0.0, 0.0],
                        [a, b] => {
                            let [u, v] = group_core::<Sdot, 2>(row(r), [a, b]);
                            [u, v, 0.0, 0.0]
                        }
                        [a, b, c] => {
                            let [u, v, w] = group_core::<Sdot, 3>(row(r), [a, b, c]);
                            [u, v, w, 0.0]
                        }
                        [a, b, c, d] => group_core::<Sdot, 4>(row(r), [a, b, c, d]),
                        _ => unreachable!("chunks of at most 4"),
                    }
                };
                for (k, g) in got.iter().enumerate().take(v.len()) {
                    out[t + k][r - first] = *g;
                }
            }
        }
    }

    /// Rows `rows` against `a` (at most `WIDE` tokens), as [`super::super::format::GroupFn`].
    ///
    /// # Safety
    /// The CPU has FEAT_I8MM; `rows` lie inside `w`; `out[t].len() == rows.len()`.
    #[target_feature(enable = "i8mm,dotprod")]
    pub(in super::super) unsafe fn wide(
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
        a: &[&ActBuf],
        out: &mut [&mut [f32]],
    ) {
        use super::super::super::format::Activation;
        use super::super::super::q8_0::ActQ8_0;
        if a.len() > 16 {
            // At most 8 pairs a pass.
            let (head, tail) = a.split_at(16);
            let (out_head, out_tail) = out.split_at_mut(16);
            // SAFETY: the caller's.
            unsafe {
                wide(w, row_bytes, rows.clone(), head, out_head);
                wide(w, row_bytes, rows, tail, out_tail);
            }
            return;
        }
        let views: Vec<&Q8Act> = a.iter().map(|a| ActQ8_0::view(a)).collect();
        if views.is_empty() {
            return;
        }
        let nb = views
            .iter()
            .fold(row_bytes / std::mem::size_of::<BlockQ4_0>(), |n, v| {
                n.min(v.blocks.len())
            });
        PACKED.with(|cell| {
            let ring = &mut *cell.borrow_mut();
            let packed = ring.get(|p| p.holds(a, nb), |p| p.pack(a, &views, nb));
            // SAFETY (every arm): i8mm is present (this function's contract).
            unsafe {
                let args = (w, row_bytes, nb, rows, &views[..], &packed.blocks[..]);
                match packed.pairs {
                    1 => rows_pairs::<1>(args.0, args.1, args.2, args.3, args.4, args.5, out),
                    2 => rows_pairs::<2>(args.0, args.1, args.2, args.3, args.4, args.5, out),
                    3 => rows_pairs::<3>(args.0, args.1, args.2, args.3, args.4, args.5, out),
                    4 => rows_pairs::<4>(args.0, args.1, args.2, args.3, args.4, args.5, out),
                    5 => rows_pairs::<5>(args.0, args.1, args.2, args.3, args.4, args.5, out),
                    6 => rows_pairs::<6>(args.0, args.1, args.2, args.3, args.4, args.5, out),
                    7 => rows_pairs::<7>(args.0, args.1, args.2, args.3, args.4, args.5, out),
                    _ => rows_pairs::<8>(args.0, args.1, args.2, args.3, args.4, args.5, out),
                }
            }
        });
    }
}

pub(super) use mm::wide as wide_i8mm;

const _: () = assert!(QK == 32);
