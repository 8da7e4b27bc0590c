//! The one trait every weight format implements ([`Format`]), the SIMD level as a slot
//! ([`Kernel`]), and the table the entry points of [`super`] dispatch through.
//!
//! Why this shape: every entry point (`quantize_row`, `dequantize_row`, `ActBuf::prepare`,
//! `matvec`, `matmul`, the benchmark) used to `match` on the tensor type, and each format's file
//! `match`ed again on the SIMD level, so a format was spread over a dozen places. Now a format
//! is one type implementing [`Format`] (its block layout, quantizer, dequantizer, activation
//! type and scalar dot — the reference every level must match bit for bit), plus one
//! `impl Kernel<ThatFormat> for Level` per SIMD level it has. [`super::registry`] lists each
//! format once with its levels; everything else looks the type up there once per call
//! ([`FormatTable`]) and calls through plain function pointers, chosen per call, not per row.
//!
//! Adding a SIMD level: a marker type implementing [`Level`], a `SimdLevel` variant detected at
//! run time, then per format an `impl Kernel<F> for TheLevel` (the aarch64 levels [`Neon`],
//! [`Dotprod`] and [`I8mm`] keep theirs in `<format>/neon.rs`, beside the format's file), and
//! the level's name in that format's registry line. A format without it runs at the best level
//! below that it has (always at least [`Scalar`]).

use super::q8_k::GROUP;
use super::{blocks, blocks_mut, ActBuf, ActFormat, RawBlock, SimdLevel};
use crate::gguf::GgmlType;
use std::ops::Range;

/// An activation representation: how an f32 vector is prepared (quantized or converted) once
/// for dot products with every weight format that takes it.
pub(crate) trait Activation: 'static {
    /// Its name in [`ActBuf`] and in errors.
    const FORMAT: ActFormat;
    /// Values per block (1 for the float forms); `prepare` takes whole blocks only.
    const BLOCK: usize;
    /// What a dot product reads.
    type View: ?Sized;
    /// Fills `buf`'s storage for this representation from `x` (a whole number of blocks,
    /// checked by the caller). Deterministic scalar code, so every SIMD level sees the same
    /// activation.
    fn prepare(x: &[f32], buf: &mut ActBuf);
    /// The prepared activation (whatever `buf` holds if it was prepared for another format;
    /// callers check [`ActBuf::format`] first).
    fn view(buf: &ActBuf) -> &Self::View;
}

/// What a dot product of format `F` reads from a prepared activation.
pub(crate) type ActView<F> = <<F as Format>::Act as Activation>::View;

/// A weight format as stored in GGUF.
///
/// Contract: `Block` is the `#[repr(C)]` block of `TY` (its size is asserted at compile time
/// against the type table, [`FormatTable::of`]); `quantize` and `dequantize` take whole blocks
/// (`src.len() == dst.len() * values per block` for `dequantize`, the reverse for `quantize`)
/// and never panic on any bytes; `dot` is the scalar reference: it fixes the summation order
/// every SIMD level reproduces bit for bit, and reads `min(w.len(), activation blocks)` blocks.
pub(crate) trait Format: 'static {
    /// The ggml type.
    const TY: GgmlType;
    /// One block as stored (float formats: one value's bytes).
    type Block: RawBlock;
    /// The activation this format is dotted with (llama.cpp's `vec_dot_type` for it).
    type Act: Activation;
    /// f32 values to blocks (deterministic; for `gen` and tests).
    fn quantize(src: &[f32], dst: &mut [Self::Block]);
    /// Blocks to f32 values.
    fn dequantize(src: &[Self::Block], dst: &mut [f32]);
    /// The scalar reference dot product of a row with a prepared activation.
    fn dot(w: &[Self::Block], a: &ActView<Self>) -> f32;
}

/// How far ahead of the row being dotted a one-token product prefetches: the bytes `PREFETCH_AHEAD`
/// past the row's start, one row's worth. A decode product streams its rows from memory and
/// computes far slower than the hardware prefetchers alone feed it: with this, 256 MiB of Q4_K
/// rows (2048 columns) went from 6.1 to 8.2 GB/s of thread CPU time, Q6_K (768 columns) from
/// 6.5 to 8.2 (one thread; 512-1024 bytes were all within 2 % of the best, none and 4096+ were
/// back at the start; docs/benchmarks.md, "Decode profile"). Prefetches change no value.
pub(super) const PREFETCH_AHEAD: usize = 768;

/// Prefetches the cache lines of `w[start..start + len]` (clipped to `w`) into every level.
#[inline(always)]
pub(super) fn prefetch_lines(w: &[u8], start: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let end = (start + len).min(w.len());
        let mut at = start;
        while at < end {
            // SAFETY: `at` lies inside `w`; a prefetch never faults and changes no value.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().add(at).cast()) };
            at += 64;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // The same lines as the x86 loop (`start + 64 i` below `end`), but four `prfm`s per
        // step with immediate offsets and one add, count and branch: a step of the plain loop
        // was four instructions per line (`prfm`, add, compare, branch), a quarter of a
        // one-token F32 product's instructions under llvm-mca, which prices them as the L1
        // hits they are there. The odd lines go first, one at a time.
        let end = (start + len).min(w.len());
        if start < end {
            let lines = (end - start).div_ceil(64);
            // An address, not a pointer: the steps stay inside `w`, but a pointer may not be
            // formed past its allocation even briefly, and `prfm` takes any address.
            let mut p = w.as_ptr() as usize + start;
            for _ in 0..lines % 4 {
                // SAFETY: a prefetch never faults and changes no value (and `prfm` is in
                // every aarch64 core). 64 bytes a step: the line of most ARM cores.
                unsafe {
                    std::arch::asm!(
                        "prfm pldl1keep, [{p}]",
                        p = in(reg) p,
                        options(nostack, preserves_flags, readonly)
                    )
                };
                p += 64;
            }
            for _ in 0..lines / 4 {
                // SAFETY: as above.
                unsafe {
                    std::arch::asm!(
                        "prfm pldl1keep, [{p}]",
                        "prfm pldl1keep, [{p}, #64]",
                        "prfm pldl1keep, [{p}, #128]",
                        "prfm pldl1keep, [{p}, #192]",
                        p = in(reg) p,
                        options(nostack, preserves_flags, readonly)
                    )
                };
                p += 256;
            }
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = (w, start, len);
}

/// A SIMD level as a type, so that a format's kernels at that level are a trait impl.
pub(crate) trait Level {
    const LEVEL: SimdLevel;
}

/// The portable level: every format's [`Format::dot`], unchanged.
pub(crate) struct Scalar;
impl Level for Scalar {
    const LEVEL: SimdLevel = SimdLevel::Scalar;
}

/// x86-64 with AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Level for Avx2 {
    const LEVEL: SimdLevel = SimdLevel::Avx2;
}

/// x86-64 with AVX-512 (F, BW, VL) and AVX512-VNNI, on top of [`Avx2`]'s features. Formats
/// without a kernel of their own at this level run their AVX2 one.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx512;
#[cfg(target_arch = "x86_64")]
impl Level for Avx512 {
    const LEVEL: SimdLevel = SimdLevel::Avx512;
}

/// aarch64 Advanced SIMD (NEON): every aarch64 core.
#[cfg(target_arch = "aarch64")]
pub(crate) struct Neon;
#[cfg(target_arch = "aarch64")]
impl Level for Neon {
    const LEVEL: SimdLevel = SimdLevel::Neon;
}

/// NEON plus the 8-bit dot products (`sdot`/`udot`). Formats without a kernel of their own at
/// this level run their NEON one.
#[cfg(target_arch = "aarch64")]
pub(crate) struct Dotprod;
#[cfg(target_arch = "aarch64")]
impl Level for Dotprod {
    const LEVEL: SimdLevel = SimdLevel::Dotprod;
}

/// dotprod plus the 8-bit matrix multiply-accumulate (`smmla`). Formats without a kernel of
/// their own at this level run their dotprod (or NEON) one.
#[cfg(target_arch = "aarch64")]
pub(crate) struct I8mm;
#[cfg(target_arch = "aarch64")]
impl Level for I8mm {
    const LEVEL: SimdLevel = SimdLevel::I8mm;
}

/// Format `F`'s products at one SIMD level. Every method gives exactly the bits of
/// [`Format::dot`] for each (row, activation) pair; the tests check it for every format and
/// level.
///
/// # Safety (for callers)
/// Every method may only be called when the CPU supports the level (`Self::LEVEL <=
/// simd_level()`); the table hands out a level's functions only then.
pub(crate) trait Kernel<F: Format>: Level {
    /// One row.
    unsafe fn dot(w: &[F::Block], a: &ActView<F>) -> f32;

    /// `out[i] = dot(row rows.start + i)` for the rows of a row-major matrix `w` of
    /// `row_bytes`-byte rows (whole blocks; `rows` inside `w`, `out.len() == rows.len()`). A
    /// level overrides it where several rows at once are faster (Q4_0's 8-row kernel).
    unsafe fn dot_rows(
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
        a: &ActView<F>,
        out: &mut [f32],
    ) {
        for (o, r) in out.iter_mut().zip(rows) {
            prefetch_lines(w, r * row_bytes + PREFETCH_AHEAD, row_bytes);
            // SAFETY: the caller's (the level is available).
            *o = unsafe { Self::dot(blocks(&w[r * row_bytes..(r + 1) * row_bytes]), a) };
        }
    }

    /// True when [`Kernel::dot_group`] is faster than single dots (it unpacks each weight
    /// block once for all its activations), so prefill should use it.
    const GROUPED: bool = false;

    /// True when the level has [`Kernel::dot_wide`] (prefill's larger batches).
    const WIDE: bool = false;

    /// The fewest tokens worth a [`Kernel::dot_wide`] call: its lanes past the last token cost
    /// as much as real ones, so below this the grouped or single dots are faster (Q4_K in L2,
    /// ns per block and token: 16 tokens 2.1, 12 tokens 2.7, 8 tokens 3.9, against 4.6 in
    /// groups of 4).
    const WIDE_MIN: usize = 8;

    /// Rows `rows` of a matrix of `row_bytes`-byte rows against `1 <= a.len() <= WIDE`
    /// activations (as [`GroupFn`]): a kernel that holds one token per vector lane. Only
    /// called when [`Kernel::WIDE`] is true; this default gives single dots.
    unsafe fn dot_wide(
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
        a: &[&ActBuf],
        out: &mut [&mut [f32]],
    ) {
        for (act, o) in a.iter().zip(out.iter_mut()) {
            // SAFETY: the caller's.
            unsafe { Self::dot_rows(w, row_bytes, rows.clone(), F::Act::view(act), o) };
        }
    }

    /// One row against `N` activations (`1 <= N <= GROUP`): prefill's groups of [`GROUP`]
    /// tokens, and the 2 or 3 tokens left over after them.
    unsafe fn dot_group<const N: usize>(w: &[F::Block], a: [&ActView<F>; N]) -> [f32; N] {
        // SAFETY: the caller's.
        a.map(|a| unsafe { Self::dot(w, a) })
    }
}

impl<F: Format> Kernel<F> for Scalar {
    unsafe fn dot(w: &[F::Block], a: &ActView<F>) -> f32 {
        F::dot(w, a)
    }
}

/// [`Kernel::dot_rows`] over raw bytes.
pub(crate) type RowsFn = unsafe fn(&[u8], usize, Range<usize>, &ActBuf, &mut [f32]);
/// [`Kernel::dot_group`] over the rows of a matrix of raw bytes (as [`RowsFn`]): `out[k][i]`
/// is row `rows.start + i` against activation `k`, for `1 <= acts.len() == out.len() <=
/// GROUP` activations.
pub(crate) type GroupFn = unsafe fn(&[u8], usize, Range<usize>, &[&ActBuf], &mut [&mut [f32]]);

/// One format's kernels at one level, as function pointers.
#[derive(Copy, Clone)]
pub(crate) struct LevelFns {
    pub level: SimdLevel,
    pub rows: RowsFn,
    /// `Some` when the level has a grouped kernel worth using ([`Kernel::GROUPED`]).
    pub group: Option<GroupFn>,
    /// `Some` when the level has a tokens-in-lanes kernel ([`Kernel::WIDE`]) for up to
    /// [`super::q8_k::WIDE`] activations.
    pub wide: Option<GroupFn>,
    /// [`Kernel::WIDE_MIN`].
    pub wide_min: usize,
}

unsafe fn rows_of<F: Format, L: Kernel<F>>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    act: &ActBuf,
    out: &mut [f32],
) {
    // SAFETY: the caller's.
    unsafe { L::dot_rows(w, row_bytes, rows, F::Act::view(act), out) }
}

unsafe fn group_of<F: Format, L: Kernel<F>>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    acts: &[&ActBuf],
    out: &mut [&mut [f32]],
) {
    const { assert!(GROUP == 4) };
    // SAFETY (every arm): the caller's.
    unsafe {
        match acts.len() {
            1 => group_n::<F, L, 1>(w, row_bytes, rows, acts, out),
            2 => group_n::<F, L, 2>(w, row_bytes, rows, acts, out),
            3 => group_n::<F, L, 3>(w, row_bytes, rows, acts, out),
            _ => group_n::<F, L, 4>(w, row_bytes, rows, acts, out),
        }
    }
}

/// [`group_of`] for `N` activations (`acts` and `out` have at least `N` entries).
#[inline(always)]
unsafe fn group_n<F: Format, L: Kernel<F>, const N: usize>(
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
    acts: &[&ActBuf],
    out: &mut [&mut [f32]],
) {
    // The activations' views once for all rows.
    let views: [&ActView<F>; N] = std::array::from_fn(|k| F::Act::view(acts[k]));
    let first = rows.start;
    for r in rows {
        // SAFETY: the caller's (the level is available; rows lie inside `w`).
        let v = unsafe { L::dot_group::<N>(blocks(&w[r * row_bytes..(r + 1) * row_bytes]), views) };
        for (o, v) in out.iter_mut().zip(v) {
            o[r - first] = v;
        }
    }
}

impl LevelFns {
    /// Format `F` at level `L`.
    pub const fn of<F: Format, L: Kernel<F>>() -> LevelFns {
        LevelFns {
            level: L::LEVEL,
            rows: rows_of::<F, L>,
            group: if L::GROUPED {
                Some(group_of::<F, L>)
            } else {
                None
            },
            wide: if L::WIDE { Some(L::dot_wide) } else { None },
            wide_min: L::WIDE_MIN,
        }
    }
}

/// How many [`SimdLevel`]s there are (the slots of a [`FormatTable`]).
const N_LEVELS: usize = SimdLevel::ALL.len();

/// One format, type-erased: what the entry points call.
pub(crate) struct FormatTable {
    pub ty: GgmlType,
    /// The activation its dots take.
    pub act: ActFormat,
    /// Values per activation block (whole blocks only).
    pub act_block: usize,
    quantize: fn(&[f32], &mut [u8]),
    dequantize: fn(&[u8], &mut [f32]),
    prepare: fn(&[f32], &mut ActBuf),
    /// Indexed by `SimdLevel as usize`; slot 0 (scalar) is always filled.
    levels: [Option<LevelFns>; N_LEVELS],
}

fn quantize_of<F: Format>(src: &[f32], dst: &mut [u8]) {
    F::quantize(src, blocks_mut(dst))
}

fn dequantize_of<F: Format>(src: &[u8], dst: &mut [f32]) {
    F::dequantize(blocks(src), dst)
}

impl FormatTable {
    /// Format `F` with its scalar level; add the others with [`FormatTable::with`].
    pub const fn of<F: Format>() -> FormatTable {
        const {
            assert!(
                std::mem::size_of::<F::Block>() as u64 == F::TY.type_size(),
                "a format's block struct must have its type's size"
            )
        };
        let mut levels = [None; N_LEVELS];
        levels[SimdLevel::Scalar as usize] = Some(LevelFns::of::<F, Scalar>());
        FormatTable {
            ty: F::TY,
            act: F::Act::FORMAT,
            act_block: F::Act::BLOCK,
            quantize: quantize_of::<F>,
            dequantize: dequantize_of::<F>,
            prepare: F::Act::prepare,
            levels,
        }
    }

    /// Adds a level's kernels.
    pub const fn with(mut self, fns: LevelFns) -> FormatTable {
        self.levels[fns.level as usize] = Some(fns);
        self
    }

    /// The kernels of the best level this format has at or below `level`.
    pub fn at(&self, level: SimdLevel) -> &LevelFns {
        let mut i = (level as usize).min(N_LEVELS - 1);
        loop {
            if let Some(f) = &self.levels[i] {
                return f;
            }
            // Slot 0 is always filled, so this stops there.
            i = i.saturating_sub(1);
        }
    }

    /// f32 values to `ty` bytes (lengths checked by the caller).
    pub fn quantize(&self, src: &[f32], dst: &mut [u8]) {
        (self.quantize)(src, dst)
    }

    /// `ty` bytes to f32 values (lengths checked by the caller).
    pub fn dequantize(&self, src: &[u8], dst: &mut [f32]) {
        (self.dequantize)(src, dst)
    }

    /// Prepares `buf` from `x` (a whole number of activation blocks, checked by the caller).
    pub fn prepare(&self, x: &[f32], buf: &mut ActBuf) {
        (self.prepare)(x, buf)
    }
}

/// The levels of a registry line: `Avx2`, `Avx512` (compiled on x86-64 only), `Neon`,
/// `Dotprod`, `I8mm` (compiled on aarch64 only).
macro_rules! with_levels {
    ($t:expr, $f:ty $(,)?) => { $t };
    ($t:expr, $f:ty, Neon $(, $rest:ident)*) => {
        $crate::kernels::format::with_levels!(@arm $t, $f, Neon $(, $rest)*)
    };
    ($t:expr, $f:ty, Dotprod $(, $rest:ident)*) => {
        $crate::kernels::format::with_levels!(@arm $t, $f, Dotprod $(, $rest)*)
    };
    ($t:expr, $f:ty, I8mm $(, $rest:ident)*) => {
        $crate::kernels::format::with_levels!(@arm $t, $f, I8mm $(, $rest)*)
    };
    (@arm $t:expr, $f:ty, $level:ident $(, $rest:ident)*) => {{
        #[cfg(target_arch = "aarch64")]
        let t = $t.with($crate::kernels::format::LevelFns::of::<$f, $crate::kernels::format::$level>());
        #[cfg(not(target_arch = "aarch64"))]
        let t = $t;
        $crate::kernels::format::with_levels!(t, $f $(, $rest)*)
    }};
    ($t:expr, $f:ty, Avx512 $(, $rest:ident)*) => {{
        #[cfg(target_arch = "x86_64")]
        let t = $t.with($crate::kernels::format::LevelFns::of::<$f, $crate::kernels::format::Avx512>());
        #[cfg(not(target_arch = "x86_64"))]
        let t = $t;
        $crate::kernels::format::with_levels!(t, $f $(, $rest)*)
    }};
    ($t:expr, $f:ty, Avx2 $(, $rest:ident)*) => {{
        #[cfg(target_arch = "x86_64")]
        let t = $t.with($crate::kernels::format::LevelFns::of::<$f, $crate::kernels::format::Avx2>());
        #[cfg(not(target_arch = "x86_64"))]
        let t = $t;
        $crate::kernels::format::with_levels!(t, $f $(, $rest)*)
    }};
}
pub(crate) use with_levels;

/// The registry: `registry! { TYPE => format type [levels beyond scalar]; ... }` defines
/// [`table`] (the one place a tensor type becomes its kernels) and [`WEIGHT_TYPES`].
macro_rules! registry {
    ($($ty:ident => $f:ty [$($level:ident),*];)*) => {
        /// Every weight format the kernels take, in registry order.
        pub(crate) const WEIGHT_TYPES: &[GgmlType] = &[$(GgmlType::$ty),*];

        /// The kernels of weight type `ty`, or `None` when it has none.
        pub(crate) fn table(ty: GgmlType) -> Option<&'static FormatTable> {
            match ty {
                $(GgmlType::$ty => {
                    static T: FormatTable =
                        $crate::kernels::format::with_levels!(FormatTable::of::<$f>(), $f $(, $level)*);
                    Some(&T)
                })*
                _ => None,
            }
        }
    };
}
pub(crate) use registry;

/// The [`Format`] and AVX2 [`Kernel`] of a 256-value format against Q8_K activations whose
/// file defines `quantize`, `dequantize`, `dot_scalar` and (x86-64) `dot_avx2` over its blocks,
/// and with `grouped`, a multi-token `dot_n_avx2`:
/// `kquant_format!(Name, GgmlTypeVariant, BlockType [, grouped])`.
macro_rules! kquant_format {
    ($name:ident, $ty:ident, $block:ty $(, $grouped:ident)?) => {
        /// The weight format (see the module header).
        pub(crate) struct $name;

        impl $crate::kernels::format::Format for $name {
            const TY: $crate::gguf::GgmlType = $crate::gguf::GgmlType::$ty;
            type Block = $block;
            type Act = $crate::kernels::q8_k::ActQ8K;

            fn quantize(src: &[f32], dst: &mut [$block]) {
                quantize(src, dst)
            }

            fn dequantize(src: &[$block], dst: &mut [f32]) {
                dequantize(src, dst)
            }

            fn dot(w: &[$block], a: &[$crate::kernels::q8_k::BlockQ8K]) -> f32 {
                dot_scalar(w, a)
            }
        }

        #[cfg(target_arch = "x86_64")]
        impl $crate::kernels::format::Kernel<$name> for $crate::kernels::format::Avx2 {
            unsafe fn dot(w: &[$block], a: &[$crate::kernels::q8_k::BlockQ8K]) -> f32 {
                // SAFETY: the caller's (AVX2, FMA and F16C are present).
                unsafe { dot_avx2(w, a) }
            }
            $($crate::kernels::format::kquant_format!(@ $grouped, $block);)?
        }
    };
    (@ grouped, $block:ty) => {
        /// The weights are unpacked once for all the group's activations.
        const GROUPED: bool = true;

        unsafe fn dot_group<const N: usize>(
            w: &[$block],
            a: [&[$crate::kernels::q8_k::BlockQ8K]; N],
        ) -> [f32; N] {
            // SAFETY: the caller's.
            unsafe { dot_n_avx2::<N>(w, a) }
        }
    };
}
pub(crate) use kquant_format;
