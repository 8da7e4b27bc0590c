//! CPU kernels: per-format dequantize / quantize / dot products, and the multi-threaded matrix ·
//! vector products the forward pass is built from.
//!
//! Why this shape: decode is bound by how fast weight bytes stream through the cores, so each
//! weight format is dotted directly against an activation that was prepared once per vector in
//! the format llama.cpp's CPU backend uses for it (Q8_0 blocks for the 32-value formats, Q8_K
//! blocks for the 256-value ones, f16 for F16, bf16 for BF16, f32 for F32). That keeps our
//! numbers close to llama.cpp's, and keeps the inner loops in integers.
//!
//! A format is one type implementing [`format::Format`] in its own file, with its SIMD levels as
//! [`format::Kernel`] impls; the registry below lists them, and every entry point here looks a
//! type up there ([`table`]) once per call (see `format.rs` for how a level, e.g. ARM NEON, is added).
//!
//! Determinism contract (the forward pass and the byte-identity gates rely on it):
//! - Every format fixes one summation order. Quantized formats sum exactly in integers inside a
//!   block, then apply the float scale once per block in a fixed order; float formats sum into a
//!   fixed set of lanes (32 for F32/F16/BF16) reduced by one fixed tree. The scalar reference
//!   and every SIMD path follow the same order, so they agree bit for bit (the tests check it),
//!   whatever the CPU.
//! - Where we know it, that order (and the activation quantizer) is the one llama.cpp's x86 CPU
//!   backend uses on one token (Q8_0: 8 fused lanes; Q4_0: one fused chain over blocks; Q4_K:
//!   two fused chains over super-blocks; Q8_0 activations rounded as its AVX code does), so our
//!   logits can equal its bit for bit. Any one-ulp difference is otherwise amplified by the next
//!   activation quantization or router top-k into visible logit differences.
//! - A row's result depends only on that row and the activation: [`matvec`] gives each row to
//!   exactly one thread, so any thread count gives identical bits, and [`matmul`] gives exactly
//!   the bits of [`matvec`] on each token.
//!
//! The SIMD level is detected once ([`simd_level`]) and cached.

// `is_multiple_of` is newer than the workspace's rust-version (1.85).
#![allow(clippy::manual_is_multiple_of)]

pub mod attn;
pub mod bench;
mod bf16;
mod block32;
mod float_dot;
pub(crate) mod format;
mod fp16;
mod fp32;
mod iq4_nl;
mod iq4_xs;
mod mxfp4;
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;
mod pool;
mod q2_k;
mod q3_k;
mod q4_0;
mod q4_1;
mod q4_k;
mod q5_0;
mod q5_1;
mod q5_k;
mod q6_k;
mod q8_0;
mod q8_k;
#[cfg(test)]
mod testutil;

pub use pool::ThreadPool;

use crate::gguf::GgmlType;
use format::{FormatTable, LevelFns};
use std::borrow::Borrow;
use std::ops::Range;
use std::sync::OnceLock;

use q8_0::Q8Act;
use q8_k::{BlockQ8K, GROUP, WIDE};

format::registry! {
    F32 => fp32::F32 [Avx2, Neon];
    F16 => fp16::F16 [Avx2, Neon];
    BF16 => bf16::Bf16 [Avx2, Neon];
    Q8_0 => q8_0::Q8_0 [Avx2, Avx512, Neon, Dotprod];
    Q4_0 => q4_0::Q4_0 [Avx2, Neon, Dotprod, I8mm];
    Q4_1 => q4_1::Q4_1 [Avx2, Neon, Dotprod];
    Q5_0 => q5_0::Q5_0 [Avx2, Neon, Dotprod];
    Q5_1 => q5_1::Q5_1 [Avx2, Neon, Dotprod];
    IQ4_NL => iq4_nl::Iq4Nl [Avx2, Neon, Dotprod];
    MXFP4 => mxfp4::Mxfp4 [Avx2, Neon, Dotprod];
    Q2_K => q2_k::Q2K [Avx2, Avx512, Neon, Dotprod, I8mm];
    Q3_K => q3_k::Q3K [Avx2, Avx512, Neon, Dotprod, I8mm];
    Q4_K => q4_k::Q4K [Avx2, Avx512, Neon, Dotprod, I8mm];
    Q5_K => q5_k::Q5K [Avx2, Neon, Dotprod, I8mm];
    Q6_K => q6_k::Q6K [Avx2, Avx512, Neon, Dotprod, I8mm];
    IQ4_XS => iq4_xs::Iq4Xs [Avx2, Neon, Dotprod, I8mm];
}

/// Everything a kernel call can reject. Kernels never panic on bad lengths or types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The operation has no kernel for this tensor type.
    #[error("{op} is not supported for {ty} tensors")]
    Unsupported { ty: GgmlType, op: &'static str },
    /// A buffer has the wrong length for the shape it was given with.
    #[error("{what} has length {actual} for {ty}, expected {expected}")]
    Length {
        ty: GgmlType,
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A row length that is not a whole number of the type's blocks.
    #[error("a {ty} row of {n_cols} values is not a whole number of {block_size}-value blocks")]
    Blocks {
        ty: GgmlType,
        n_cols: usize,
        block_size: usize,
    },
    /// The activation was prepared for another format or another row length.
    #[error(
        "activation prepared as {prepared} with {prepared_cols} columns cannot be used with \
         {ty} weights of {n_cols} columns (prepare it for {ty})"
    )]
    Activation {
        ty: GgmlType,
        prepared: &'static str,
        prepared_cols: usize,
        n_cols: usize,
    },
    /// A row range outside the matrix.
    #[error("rows {start}..{end} are outside a {ty} matrix of {n_rows} rows")]
    Rows {
        ty: GgmlType,
        start: usize,
        end: usize,
        n_rows: usize,
    },
}

/// The instruction-set level the kernels run at, detected once per process.
///
/// The variants are the levels of the target architecture (x86-64: AVX2, AVX-512; aarch64:
/// NEON, dotprod, i8mm), lowest first, so that a level includes every level below it and a
/// format without a kernel at one level runs its best lower one.
///
/// `BMOE_SIMD=scalar|avx2|avx512` (x86-64) or `scalar|neon|dotprod|i8mm` (aarch64) caps it (to
/// compare levels with one binary; a level the CPU lacks is never used).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    /// Portable Rust; the reference every other level matches bit for bit.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2's features plus AVX-512 F/BW/VL and AVX512-VNNI (`vpdpwssd`): the K-quant kernels
    /// that measured faster with 512-bit vectors (Intel Sapphire Rapids); every other format
    /// runs its AVX2 kernel at this level.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// aarch64 Advanced SIMD (every ARMv8-A core: 128-bit vectors, fused multiply-add).
    #[cfg(target_arch = "aarch64")]
    Neon,
    /// NEON plus the 8-bit dot products (`sdot`/`udot`, FEAT_DotProd: Cortex-A76/A55 and later).
    #[cfg(target_arch = "aarch64")]
    Dotprod,
    /// dotprod plus the 8-bit matrix multiply-accumulate (`smmla`, FEAT_I8MM: Cortex-A710/X2
    /// and later).
    #[cfg(target_arch = "aarch64")]
    I8mm,
}

impl SimdLevel {
    /// Every level of this target architecture, lowest first.
    pub const ALL: &'static [SimdLevel] = &[
        SimdLevel::Scalar,
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2,
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512,
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Neon,
        #[cfg(target_arch = "aarch64")]
        SimdLevel::Dotprod,
        #[cfg(target_arch = "aarch64")]
        SimdLevel::I8mm,
    ];

    /// Lower-case name, as printed by the benchmark and taken by `BMOE_SIMD`.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => "avx512",
            #[cfg(target_arch = "aarch64")]
            SimdLevel::Neon => "neon",
            #[cfg(target_arch = "aarch64")]
            SimdLevel::Dotprod => "dotprod",
            #[cfg(target_arch = "aarch64")]
            SimdLevel::I8mm => "i8mm",
        }
    }

    /// The level named `name` ([`SimdLevel::name`]) on this architecture, if any.
    pub fn from_name(name: &str) -> Option<SimdLevel> {
        SimdLevel::ALL.iter().copied().find(|l| l.name() == name)
    }

    /// Every level this CPU can run, lowest first (always starts with `Scalar`).
    pub fn available() -> Vec<SimdLevel> {
        let top = simd_level();
        SimdLevel::ALL
            .iter()
            .copied()
            .filter(|l| *l <= top)
            .collect()
    }

    /// The best level of this architecture (what the kernels run when nothing caps them).
    pub fn top() -> SimdLevel {
        SimdLevel::ALL[SimdLevel::ALL.len() - 1]
    }
}

/// The best level this CPU supports, detected on first use and cached.
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(detect_level)
}

fn detect_level() -> SimdLevel {
    let cap = match std::env::var("BMOE_SIMD") {
        Ok(name) => simd_cap(&name).unwrap_or_else(|| {
            let names: Vec<&str> = SimdLevel::ALL.iter().map(|l| l.name()).collect();
            eprintln!(
                "bmoe: BMOE_SIMD={name:?} is not a level of this CPU architecture ({}); \
                 running the best level the CPU has",
                names.join(", ")
            );
            SimdLevel::top()
        }),
        Err(_) => SimdLevel::top(),
    };
    cpu_level().min(cap)
}

/// The cap `BMOE_SIMD=name` sets (empty: none), or `None` for a name this architecture lacks.
fn simd_cap(name: &str) -> Option<SimdLevel> {
    if name.is_empty() {
        return Some(SimdLevel::top());
    }
    SimdLevel::from_name(&name.to_ascii_lowercase())
}

fn cpu_level() -> SimdLevel {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                return SimdLevel::Avx512;
            }
            return SimdLevel::Avx2;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        // Advanced SIMD is part of every aarch64 Linux/Android target; the 8-bit dot and
        // matrix instructions are optional (ARMv8.2+ and ARMv8.6+).
        if std::arch::is_aarch64_feature_detected!("dotprod") {
            if std::arch::is_aarch64_feature_detected!("i8mm") {
                return SimdLevel::I8mm;
            }
            return SimdLevel::Dotprod;
        }
        return SimdLevel::Neon;
    }
    #[allow(unreachable_code)]
    SimdLevel::Scalar
}

/// The representation an activation vector takes for dot products with one weight type.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ActFormat {
    F32,
    F16,
    Bf16,
    /// Blocks of 32 int8 with an f16 scale, with each block's quant sum and llama.cpp's Q8_1
    /// sum term beside them (for the 32-value weight formats).
    Q8_0,
    /// Blocks of 256 int8 with an f32 scale and 16 int16 sums (for the 256-value formats).
    Q8K,
}

impl ActFormat {
    /// The format activations take against weights of type `ty`, or `None` when there is no
    /// dot kernel for `ty`.
    pub fn for_weights(ty: GgmlType) -> Option<ActFormat> {
        table(ty).map(|t| t.act)
    }

    fn name(self) -> &'static str {
        match self {
            ActFormat::F32 => "F32",
            ActFormat::F16 => "F16",
            ActFormat::Bf16 => "BF16",
            ActFormat::Q8_0 => "Q8_0",
            ActFormat::Q8K => "Q8_K",
        }
    }
}

/// Every weight type the kernels take (dot, quantize, dequantize), in a fixed order.
pub fn weight_types() -> &'static [GgmlType] {
    WEIGHT_TYPES
}

/// True when [`dot_rows`], [`matvec`] and [`matmul`] accept weights of type `ty`.
pub fn supports_dot(ty: GgmlType) -> bool {
    table(ty).is_some()
}

/// True when [`quantize_row`] and [`dequantize_row`] accept type `ty` (every weight format).
pub fn supports_quantize(ty: GgmlType) -> bool {
    table(ty).is_some()
}

/// Bytes of a row of `n_cols` values of type `ty`, checking that the row is whole blocks.
fn row_bytes_of(ty: GgmlType, n_cols: usize) -> Result<usize, KernelError> {
    let block_size = ty.block_size() as usize;
    let bytes = ty.row_bytes(n_cols as u64).ok_or(KernelError::Blocks {
        ty,
        n_cols,
        block_size,
    })?;
    usize::try_from(bytes).map_err(|_| KernelError::Blocks {
        ty,
        n_cols,
        block_size,
    })
}

/// Checks a [`quantize_row`] / [`dequantize_row`] call (`op`): `ty` has a quantizer,
/// `n_values` is a whole number of its blocks, and the byte side (`what`) is exactly that
/// row's bytes. Returns the format.
fn check_row(
    ty: GgmlType,
    op: &'static str,
    what: &'static str,
    n_values: usize,
    n_bytes: usize,
) -> Result<&'static FormatTable, KernelError> {
    let t = table(ty).ok_or(KernelError::Unsupported { ty, op })?;
    let row_bytes = row_bytes_of(ty, n_values)?;
    if n_bytes != row_bytes {
        return Err(KernelError::Length {
            ty,
            what,
            expected: row_bytes,
            actual: n_bytes,
        });
    }
    Ok(t)
}

/// Quantizes (or converts) one row of f32 values to type `ty`.
///
/// `src.len()` must be a whole number of `ty` blocks and `dst.len()` exactly the row's bytes
/// (`ty.row_bytes(src.len())`). Deterministic: the same input gives the same bytes on every
/// machine and SIMD level (quantizers are scalar). The K-quant and IQ4 quantizers fit each
/// block directly (min-max or absmax, then one refit); they are correct but not as tuned as
/// llama.cpp's searches, so synthetic models are slightly noisier than `llama-quantize` output.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), KernelError> {
    let t = check_row(
        ty,
        "quantize",
        "quantize destination (bytes)",
        src.len(),
        dst.len(),
    )?;
    t.quantize(src, dst);
    Ok(())
}

/// Expands one row of type `ty` to f32.
///
/// `dst.len()` must be a whole number of blocks and `src.len()` exactly its row bytes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    let t = check_row(
        ty,
        "dequantize",
        "dequantize source (bytes)",
        dst.len(),
        src.len(),
    )?;
    t.dequantize(src, dst);
    Ok(())
}

/// The next [`ActBuf`] stamp. Every preparation takes a fresh one, so equal stamps mean equal
/// contents (a clone keeps its original's stamp and contents).
static STAMPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// An activation vector prepared for dot products with weights of one type (see
/// [`ActFormat::for_weights`]).
///
/// Reusable: [`ActBuf::prepare`] keeps its buffers, so once they have grown to the largest row
/// used it never allocates again. A buffer prepared for one weight type serves every type with
/// the same [`ActFormat`] (e.g. Q4_0 and Q8_0; Q4_K, Q5_K and Q6_K).
#[derive(Default, Clone, Debug)]
pub struct ActBuf {
    format: Option<ActFormat>,
    n_cols: usize,
    /// Names the contents of the last successful preparation (0: none), unique in the process
    /// ([`STAMPS`]): the lanes kernels repack their tokens only when a stamp changed.
    stamp: u64,
    f32s: Vec<f32>,
    u16s: Vec<u16>,
    q8_0: Q8Act,
    q8_k: Vec<BlockQ8K>,
}

impl ActBuf {
    /// An empty buffer (prepared for nothing; any dot with it is an error until `prepare`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Converts `x` for dot products with `ty` weights. `x.len()` is the weight rows' column
    /// count and must be a whole number of the activation format's blocks (32 for Q8_0, 256 for
    /// Q8_K). Deterministic: every SIMD level writes the scalar code's bytes (Q8_K's
    /// vectorised quantizer included), so every level sees the same activation.
    pub fn prepare(&mut self, ty: GgmlType, x: &[f32]) -> Result<(), KernelError> {
        let t = table(ty).ok_or(KernelError::Unsupported { ty, op: "dot" })?;
        // Mark unprepared until the conversion succeeded.
        self.format = None;
        self.n_cols = 0;
        check_blocks(ty, x.len(), t.act_block)?;
        self.fill(t, x);
        Ok(())
    }

    /// The conversion of [`ActBuf::prepare`], `x` already checked for `t`.
    fn fill(&mut self, t: &FormatTable, x: &[f32]) {
        t.prepare(x, self);
        self.format = Some(t.act);
        self.n_cols = x.len();
        self.stamp = STAMPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// See the field: what a kernel caching a transformed copy of this activation keys it by.
    pub(crate) fn stamp(&self) -> u64 {
        self.stamp
    }

    /// The format of the last successful `prepare`, if any.
    pub fn format(&self) -> Option<ActFormat> {
        self.format
    }

    /// The number of values of the last successful `prepare`.
    pub fn n_cols(&self) -> usize {
        self.n_cols
    }

    fn check_for(&self, t: &FormatTable, n_cols: usize) -> Result<(), KernelError> {
        if self.format != Some(t.act) || self.n_cols != n_cols {
            return Err(KernelError::Activation {
                ty: t.ty,
                prepared: self.format.map(ActFormat::name).unwrap_or("nothing"),
                prepared_cols: self.n_cols,
                n_cols,
            });
        }
        Ok(())
    }
}

/// A batch's activations, quantised once: `acts[i]` is prepared for `ty` weights from row `i`
/// of `x` (rows of `n_cols` values; `x.len() == acts.len() * n_cols`), exactly as
/// [`ActBuf::prepare`] would, with the rows split across the pool's threads. Every row in
/// `acts` is left unprepared when the call fails.
pub fn prepare_rows(
    pool: &ThreadPool,
    ty: GgmlType,
    x: &[f32],
    n_cols: usize,
    acts: &mut [ActBuf],
) -> Result<(), KernelError> {
    for a in acts.iter_mut() {
        a.format = None;
        a.n_cols = 0;
    }
    let t = table(ty).ok_or(KernelError::Unsupported { ty, op: "dot" })?;
    check_blocks(ty, n_cols, t.act_block)?;
    let n = acts.len();
    if x.len() != n.saturating_mul(n_cols) {
        return Err(KernelError::Length {
            ty,
            what: "activation rows (rows x columns)",
            expected: n.saturating_mul(n_cols),
            actual: x.len(),
        });
    }
    // A few rows are not worth waking the workers for (decode: one row).
    if n < 4 || n * n_cols < 8 * 1024 {
        for (a, row) in acts.iter_mut().zip(x.chunks_exact(n_cols.max(1))) {
            a.fill(t, row);
        }
        return Ok(());
    }
    let per = n.div_ceil(pool.n_threads() * 2).max(1);
    let base = OutPtr(acts.as_mut_ptr());
    pool.run(n.div_ceil(per), &|task| {
        for i in task * per..((task + 1) * per).min(n) {
            // SAFETY: row i < n belongs to this task only, and `run` returns only when every
            // task is done, so the pointer does not outlive `acts`' borrow.
            let a = unsafe { &mut *base.get().add(i) };
            a.fill(t, &x[i * n_cols..(i + 1) * n_cols]);
        }
    });
    Ok(())
}

fn check_blocks(ty: GgmlType, n_cols: usize, block_size: usize) -> Result<(), KernelError> {
    if n_cols % block_size != 0 {
        return Err(KernelError::Blocks {
            ty,
            n_cols,
            block_size,
        });
    }
    Ok(())
}

/// Marker for the block structs that may be viewed in place over raw bytes: `#[repr(C)]`,
/// alignment 1, no padding, every bit pattern valid.
///
/// # Safety
/// Implementors must satisfy exactly that.
pub(crate) unsafe trait RawBlock: Copy + 'static {}

// SAFETY: byte arrays: alignment 1, no padding, any bits valid (the float formats' "blocks").
unsafe impl<const N: usize> RawBlock for [u8; N] {}

/// Views whole blocks over `bytes` (callers check the length is a multiple first).
fn blocks<B: RawBlock>(bytes: &[u8]) -> &[B] {
    const { assert!(std::mem::align_of::<B>() == 1) };
    let n = bytes.len() / std::mem::size_of::<B>();
    // SAFETY: B has alignment 1, no padding and no invalid bit patterns (RawBlock), and the
    // n blocks lie inside `bytes`.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<B>(), n) }
}

fn blocks_mut<B: RawBlock>(bytes: &mut [u8]) -> &mut [B] {
    const { assert!(std::mem::align_of::<B>() == 1) };
    let n = bytes.len() / std::mem::size_of::<B>();
    // SAFETY: as in `blocks`, and the borrow is unique.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<B>(), n) }
}

/// An f16 (little-endian bits) as f32, exactly, in a few inlinable instructions: the hot loops
/// convert a scale per block, and the `half` crate's conversion is an out-of-line call (it
/// checks for F16C at run time), which makes the compiler spill every vector register around
/// it. Normal values move their exponent and mantissa into place; subnormals (common: block
/// scales below 6e-5) are their mantissa times 2^-24, an exact integer-to-float conversion and
/// scaling with no subnormal arithmetic (which would cost a microcode assist per call);
/// infinities and NaNs keep the all-ones exponent (NaNs made quiet, payload kept, as F16C
/// does). Bit-identical to the hardware conversion for all 65536 inputs (a test checks every
/// one).
#[inline(always)]
fn f16_to_f32(bits: [u8; 2]) -> f32 {
    let h = u16::from_le_bytes(bits) as u32;
    let (exponent, mantissa) = ((h >> 10) & 0x1f, h & 0x3ff);
    let magnitude = match exponent {
        0 => (mantissa as f32 * f32::from_bits((127 - 24) << 23)).to_bits(),
        31 => 0x7f80_0000 | (mantissa << 13) | if mantissa != 0 { 0x0040_0000 } else { 0 },
        e => ((e + 112) << 23) | (mantissa << 13),
    };
    f32::from_bits(magnitude | ((h & 0x8000) << 16))
}

/// [`f16_to_f32`] with the F16C instruction, for the AVX2 paths: the same bits, one instruction
/// where the portable form is several.
///
/// # Safety
/// F16C is present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16c(bits: [u8; 2]) -> f32 {
    // SAFETY: the caller's.
    unsafe { f16c_mul(bits, F16_ONE) }
}

/// `vpermd` indices for the K-quants with 16 runs of 16 values (Q2_K, Q3_K): in vector `c` of a
/// block decoded 64 values a vector (values `64c .. 64c + 64`), every dword of 128-bit lane `i`
/// selects run `4c + i` (the run of those 16 values).
#[cfg(target_arch = "x86_64")]
const RUN_IDX: [[u32; 16]; 4] = {
    let mut m = [[0u32; 16]; 4];
    let mut c = 0;
    while c < 4 {
        let mut i = 0;
        while i < 16 {
            m[c][i] = (4 * c + i / 4) as u32;
            i += 1;
        }
        c += 1;
    }
    m
};

/// 1.0 as f16 bits.
#[cfg(target_arch = "x86_64")]
const F16_ONE: [u8; 2] = [0x00, 0x3c];

/// `f16_to_f32(a) * f16_to_f32(b)` (the same bits) with one F16C conversion of both. Both values
/// go into the vector register as one 32-bit word: a lone half loaded into a lane is merged by
/// the compiler into whatever register is at hand — in the dot loops the accumulator, which
/// then chains every block's scale conversion behind the previous block's FMA (Q8_0 ran at a
/// third of its speed that way).
///
/// # Safety
/// F16C is present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16c_mul(a: [u8; 2], b: [u8; 2]) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's.
    let v = unsafe { f16c_pair(a, b) };
    _mm_cvtss_f32(_mm_mul_ss(v, _mm_movehdup_ps(v)))
}

/// `[a, b, 0, 0]` widened from f16 with one F16C conversion (see [`f16c_mul`]).
///
/// # Safety
/// F16C is present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16c_pair(a: [u8; 2], b: [u8; 2]) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    let word = u16::from_le_bytes(a) as u32 | ((u16::from_le_bytes(b) as u32) << 16);
    _mm_cvtph_ps(_mm_cvtsi32_si128(word as i32))
}

#[inline(always)]
fn f32_to_f16(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// The value of largest magnitude in `x` (the first on ties; 0 when every value is 0 or NaN),
/// which the absmax quantizers map to their most negative level.
#[inline(always)]
fn max_by_magnitude(x: &[f32]) -> f32 {
    let mut amax = 0f32;
    let mut max = 0f32;
    for v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = *v;
        }
    }
    max
}

/// Round to nearest, ties to even (llama.cpp's `nearest_int`).
///
/// Below 2^21 in magnitude (every activation quant, every weight level) it adds 1.5 · 2^23:
/// the sum lies inside [2^23, 2^24), where the float spacing is 1, so the hardware's
/// round-to-nearest-even addition leaves `round_ties_even(v)` in the low mantissa bits. The
/// same integer as `round_ties_even`, but inline: the build targets baseline x86-64 (no
/// SSE4.1 `roundss`), where `round_ties_even` is a call into libm's `rintf` per value — 8 % of
/// a prefill's time, in the activation quantizers. Larger values and NaN take that call.
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
                                     // 2^21, not 2^22: just below 2^22 the sum would round up to 2^24, where the spacing is 2.
    if v.abs() < 2_097_152.0 {
        ((v + MAGIC).to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
    } else {
        v.round_ties_even() as i32
    }
}

/// The fixed reduction of 8 lanes: the same tree a 256-bit horizontal add performs
/// (halves, then quarters, then pairs).
#[inline(always)]
fn reduce8(l: &[f32; 8]) -> f32 {
    let a = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let b = [a[0] + a[2], a[1] + a[3]];
    b[0] + b[1]
}

/// The fixed reduction of 32 lanes: fold halves until one lane is left.
#[inline(always)]
fn reduce32(l: &[f32; 32]) -> f32 {
    let mut v = *l;
    let mut width = 16;
    while width > 0 {
        for k in 0..width {
            v[k] += v[k + width];
        }
        width /= 2;
    }
    v[0]
}

/// Dot product of one weight row (exactly its row bytes) at `level` with an activation
/// checked for `t` (for the tests and the single-row paths).
#[cfg(test)]
fn dot_row(t: &FormatTable, level: SimdLevel, w_row: &[u8], act: &ActBuf) -> f32 {
    let f = t.at(level.min(simd_level()));
    let mut out = [f32::NAN];
    // SAFETY: `at` never returns a level above the one this CPU supports; `w_row` is one row.
    unsafe { (f.rows)(w_row, w_row.len(), 0..1, act, &mut out) };
    out[0]
}

/// Checks a weight matrix's type and length; returns its format and row bytes.
fn check_matrix(
    ty: GgmlType,
    w_len: usize,
    n_rows: usize,
    n_cols: usize,
) -> Result<(&'static FormatTable, usize), KernelError> {
    let t = table(ty).ok_or(KernelError::Unsupported { ty, op: "dot" })?;
    let row_bytes = row_bytes_of(ty, n_cols)?;
    let expected = row_bytes.checked_mul(n_rows).ok_or(KernelError::Length {
        ty,
        what: "weights (bytes)",
        expected: usize::MAX,
        actual: w_len,
    })?;
    if w_len != expected {
        return Err(KernelError::Length {
            ty,
            what: "weights (bytes)",
            expected,
            actual: w_len,
        });
    }
    Ok((t, row_bytes))
}

/// `out[r - rows.start] = dot(row r of w, act)` for `r` in `rows`, on the calling thread.
///
/// `w` is a whole row-major matrix of `ty` rows of `n_cols` values (its length a multiple of
/// the row bytes), `rows` must lie inside it, `act` must be prepared for `ty` with `n_cols`
/// values, and `out.len() == rows.len()`. Gives exactly the bits [`matvec`] gives for those
/// rows.
pub fn dot_rows(
    ty: GgmlType,
    w: &[u8],
    n_cols: usize,
    rows: Range<usize>,
    act: &ActBuf,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let t = table(ty).ok_or(KernelError::Unsupported { ty, op: "dot" })?;
    let row_bytes = row_bytes_of(ty, n_cols)?;
    let n_rows = w.len().checked_div(row_bytes).unwrap_or(0);
    if row_bytes == 0 || w.len() % row_bytes != 0 {
        return Err(KernelError::Length {
            ty,
            what: "weights (bytes, a multiple of the row bytes)",
            expected: n_rows * row_bytes,
            actual: w.len(),
        });
    }
    if rows.start > rows.end || rows.end > n_rows {
        return Err(KernelError::Rows {
            ty,
            start: rows.start,
            end: rows.end,
            n_rows,
        });
    }
    if out.len() != rows.len() {
        return Err(KernelError::Length {
            ty,
            what: "output",
            expected: rows.len(),
            actual: out.len(),
        });
    }
    act.check_for(t, n_cols)?;
    let f = t.at(simd_level());
    // SAFETY: the level is available (`at` takes at most this CPU's level); rows lie inside
    // `w`, which is whole rows of whole blocks, and `out` has one slot per row (checked above).
    unsafe { (f.rows)(w, row_bytes, rows, act, out) };
    Ok(())
}

/// A raw output pointer (values, or activation buffers being prepared) shared by the tasks of
/// one call; each task writes disjoint elements.
struct OutPtr<T>(*mut T);
impl<T> Clone for OutPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for OutPtr<T> {}
// SAFETY: tasks write disjoint indices, and `ThreadPool::run` returns only when all are done,
// so the pointer never outlives the borrow it came from nor aliases another writer.
unsafe impl<T: Send> Send for OutPtr<T> {}
unsafe impl<T: Send> Sync for OutPtr<T> {}
impl<T> OutPtr<T> {
    #[inline(always)]
    fn get(self) -> *mut T {
        self.0
    }

    /// # Safety
    /// `start..start + len` in bounds of the original slice and written by one task only.
    #[inline(always)]
    unsafe fn slice<'a>(self, start: usize, len: usize) -> &'a mut [T] {
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// Below this many weight bytes a product runs on the caller alone: waking workers costs more.
const PARALLEL_MIN_BYTES: usize = 64 * 1024;

/// Rows per task: several tasks per thread so a descheduled thread's work is picked up by the
/// others, but each task long enough (≥ 32 KiB of weights) that the hardware prefetcher streams.
fn rows_per_task(n_rows: usize, row_bytes: usize, n_threads: usize) -> usize {
    if n_threads <= 1 || n_rows * row_bytes < PARALLEL_MIN_BYTES {
        return n_rows.max(1);
    }
    let by_balance = n_rows.div_ceil(n_threads * 4);
    let by_size = (32 * 1024usize).div_ceil(row_bytes.max(1));
    by_balance.max(by_size).max(1)
}

/// `out = W · act`: `W` is `n_rows` × `n_cols` of type `ty` (GGUF row-major rows, `w.len()`
/// exactly `n_rows` row bytes), `act` prepared for `ty` with `n_cols` values,
/// `out.len() == n_rows`.
///
/// Rows are split across the pool's threads; each row is computed by exactly one thread with
/// the same code, so the result is bit-identical for any thread count (and equal to
/// [`dot_rows`]).
pub fn matvec(
    pool: &ThreadPool,
    ty: GgmlType,
    w: &[u8],
    n_rows: usize,
    n_cols: usize,
    act: &ActBuf,
    out: &mut [f32],
) -> Result<(), KernelError> {
    matvec_at(pool, simd_level(), ty, w, n_rows, n_cols, act, out)
}

/// [`matvec`] at a given SIMD level (for the benchmark and tests; `level` must be available).
#[allow(clippy::too_many_arguments)]
fn matvec_at(
    pool: &ThreadPool,
    level: SimdLevel,
    ty: GgmlType,
    w: &[u8],
    n_rows: usize,
    n_cols: usize,
    act: &ActBuf,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let (t, row_bytes) = check_matrix(ty, w.len(), n_rows, n_cols)?;
    if out.len() != n_rows {
        return Err(KernelError::Length {
            ty,
            what: "output",
            expected: n_rows,
            actual: out.len(),
        });
    }
    act.check_for(t, n_cols)?;
    let f = *t.at(level.min(simd_level()));
    let chunk = rows_per_task(n_rows, row_bytes, pool.n_threads());
    let n_tasks = n_rows.div_ceil(chunk);
    let out_ptr = OutPtr(out.as_mut_ptr());
    pool.run(n_tasks, &|task| {
        let start = task * chunk;
        let end = (start + chunk).min(n_rows);
        // SAFETY: rows start..end < n_rows == out.len() belong to this task only; the level is
        // available (`at` takes at most this CPU's level), and `w` is n_rows whole rows.
        unsafe {
            let out = out_ptr.slice(start, end - start);
            (f.rows)(w, row_bytes, start..end, act, out);
        }
    });
    Ok(())
}

/// Prefill: `out[t * n_rows + r] = dot(row r of W, acts[t])` for every token `t` (token-major,
/// `out.len() == acts.len() * n_rows`). Every `acts[t]` must be prepared for `ty` with `n_cols`
/// values.
///
/// Each (token, row) value has exactly the bits [`matvec`] gives for that token (the kernels
/// compute the same integers and the same float steps per token). Speed comes from order: a
/// task takes a band of rows small enough to stay in cache and runs every token over it, so
/// each weight byte comes from memory once; where a format has a grouped kernel (Q4_K, Q5_K, Q6_K)
/// groups of 4 tokens share one unpacking of each weight block.
///
/// `acts` may be owned buffers or references, so a caller can pick a subset of a batch's
/// activations prepared once ([`prepare_rows`]) — an expert's rows — without copying them.
pub fn matmul<A: Borrow<ActBuf> + Sync>(
    pool: &ThreadPool,
    ty: GgmlType,
    w: &[u8],
    n_rows: usize,
    n_cols: usize,
    acts: &[A],
    out: &mut [f32],
) -> Result<(), KernelError> {
    matmul_round(
        pool,
        &mut [Product {
            ty,
            w,
            n_rows,
            n_cols,
            acts,
            out,
        }],
    )
}

/// One product of a [`matmul_round`]: `out = W · acts` as [`matmul`] takes it.
pub struct Product<'a, A> {
    pub ty: GgmlType,
    pub w: &'a [u8],
    pub n_rows: usize,
    pub n_cols: usize,
    pub acts: &'a [A],
    pub out: &'a mut [f32],
}

/// A checked [`Product`]'s plan: its inputs, kernels, row bytes, task split and output (as a
/// raw pointer: the tasks write disjoint parts of it).
struct Planned<'a, A> {
    w: &'a [u8],
    n_rows: usize,
    acts: &'a [A],
    f: LevelFns,
    row_bytes: usize,
    chunk: usize,
    first_task: usize,
    out: OutPtr<f32>,
}

/// Several independent products in one round of the pool (the projections that read the same
/// input: attention's q, k and v; an FFN's gate and up), so the threads hand off once instead
/// of once per product. Each product gets exactly the bits [`matmul`] (and, for one
/// activation, [`matvec`]) gives it: the same kernels over the same rows, only the tasks of all
/// products are claimed from one counter. Nothing is computed unless every product checks.
pub fn matmul_round<A: Borrow<ActBuf> + Sync>(
    pool: &ThreadPool,
    products: &mut [Product<'_, A>],
) -> Result<(), KernelError> {
    let mut plans = Vec::with_capacity(products.len());
    let mut n_tasks = 0;
    for p in products.iter_mut() {
        let (t, row_bytes) = check_matrix(p.ty, p.w.len(), p.n_rows, p.n_cols)?;
        let expected = p.acts.len().saturating_mul(p.n_rows);
        if p.out.len() != expected {
            return Err(KernelError::Length {
                ty: p.ty,
                what: "output (tokens x rows)",
                expected,
                actual: p.out.len(),
            });
        }
        for act in p.acts {
            act.borrow().check_for(t, p.n_cols)?;
        }
        let chunk = if p.acts.len() <= 1 {
            // One token: matvec's split.
            rows_per_task(p.n_rows, row_bytes, pool.n_threads())
        } else {
            // A band of rows of at most ~128 KiB stays in L2 while all tokens pass over it.
            let band = (128 * 1024usize).div_ceil(row_bytes.max(1)).clamp(1, 64);
            rows_per_task(p.n_rows, row_bytes * p.acts.len(), pool.n_threads()).min(band)
        }
        .max(1);
        plans.push(Planned {
            w: p.w,
            n_rows: p.n_rows,
            acts: p.acts,
            f: *t.at(simd_level()),
            row_bytes,
            chunk,
            first_task: n_tasks,
            out: OutPtr(p.out.as_mut_ptr()),
        });
        n_tasks += if p.acts.is_empty() {
            0
        } else {
            p.n_rows.div_ceil(chunk)
        };
    }
    pool.run(n_tasks, &|task| {
        // The product owning this task: the last whose first task is at or before it.
        let p = &plans[plans.partition_point(|p| p.first_task <= task) - 1];
        let start = (task - p.first_task) * p.chunk;
        let end = (start + p.chunk).min(p.n_rows);
        // SAFETY: rows start..end of every token of this product belong to this task only;
        // the level is available (`at` takes at most this CPU's level) and `w` is n_rows
        // whole rows (checked above).
        unsafe { product_task(p, start..end) };
    });
    Ok(())
}

/// Rows `rows` of planned product `p` for every token: groups of tokens through the grouped
/// kernel where the format has one, the rest one token at a time.
///
/// # Safety
/// Rows `rows` (inside `p.n_rows`) of every token are written by this call only, and `p` was
/// planned from a checked product ([`matmul_round`]) whose output is still borrowed.
#[inline]
unsafe fn product_task<A: Borrow<ActBuf>>(p: &Planned<'_, A>, rows: Range<usize>) {
    let (acts, n_rows, w, f, row_bytes, out) = (p.acts, p.n_rows, p.w, &p.f, p.row_bytes, p.out);
    let (start, len) = (rows.start, rows.len());
    let mut t = 0;
    // Batches of up to WIDE tokens, one per vector lane, while at least the kernel's
    // `WIDE_MIN` are left.
    if let Some(wide) = f.wide {
        while acts.len() - t >= f.wide_min {
            let n = (acts.len() - t).min(WIDE);
            let batch: [&ActBuf; WIDE] = std::array::from_fn(|k| acts[t + k.min(n - 1)].borrow());
            // SAFETY: as for the groups below.
            unsafe {
                let mut outs: [&mut [f32]; WIDE] = std::array::from_fn(|k| {
                    if k < n {
                        out.slice((t + k) * n_rows + start, len)
                    } else {
                        &mut []
                    }
                });
                wide(w, row_bytes, rows.clone(), &batch[..n], &mut outs[..n]);
            }
            t += n;
        }
    }
    // Groups of up to GROUP tokens (the last one narrower) through a kernel that unpacks each
    // weight block once for all; a lone token left over takes the one-token kernel.
    if let Some(group) = f.group {
        while acts.len() - t >= 2 {
            let n = (acts.len() - t).min(GROUP);
            let group_acts: [&ActBuf; GROUP] =
                std::array::from_fn(|k| acts[t + k.min(n - 1)].borrow());
            // SAFETY: the caller's; token t + k's rows lie inside `out` (t + k < acts.len()),
            // and the n slices are disjoint (one per token).
            unsafe {
                let mut outs: [&mut [f32]; GROUP] = std::array::from_fn(|k| {
                    if k < n {
                        out.slice((t + k) * n_rows + start, len)
                    } else {
                        &mut []
                    }
                });
                group(w, row_bytes, rows.clone(), &group_acts[..n], &mut outs[..n]);
            }
            t += n;
        }
    }
    for (t, act) in acts.iter().enumerate().skip(t) {
        // SAFETY: the caller's; t * n_rows + rows lies inside `out`.
        unsafe {
            let o = out.slice(t * n_rows + start, len);
            (f.rows)(w, row_bytes, rows.clone(), act.borrow(), o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;

    /// Every weight type the kernels take, with a column count that exercises tails (of the
    /// float formats' 32 lanes, of Q4_0's groups of 8 blocks).
    fn dot_types() -> Vec<(GgmlType, usize)> {
        weight_types()
            .iter()
            .map(|&ty| {
                let n_cols = match ty.block_size() {
                    1 => 333,
                    32 => 32 * 19,
                    b => b as usize * 3,
                };
                (ty, n_cols)
            })
            .collect()
    }

    fn quantized_matrix(ty: GgmlType, n_rows: usize, n_cols: usize, seed: u64) -> Vec<u8> {
        (0..n_rows)
            .flat_map(|r| quantized_bytes(ty, &values(seed + r as u64, n_cols, 0.05)))
            .collect()
    }

    #[test]
    fn supports_tables_match_dispatch() {
        for ty in GgmlType::all() {
            let mut buf = ActBuf::new();
            let x = vec![0.5f32; 256];
            assert_eq!(buf.prepare(ty, &x).is_ok(), supports_dot(ty), "{ty}");
            let row_bytes = ty.row_bytes(256).unwrap_or(0) as usize;
            let mut dst = vec![0u8; row_bytes];
            assert_eq!(
                quantize_row(ty, &x, &mut dst).is_ok(),
                supports_quantize(ty),
                "{ty}"
            );
            let mut back = vec![0f32; 256];
            assert_eq!(
                dequantize_row(ty, &dst, &mut back).is_ok(),
                supports_quantize(ty),
                "{ty}"
            );
        }
    }

    #[test]
    fn matvec_is_bit_identical_for_any_thread_count() {
        let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
        for (i, (ty, n_cols)) in dot_types().into_iter().enumerate() {
            // Odd row counts, and one large enough to be split across tasks.
            for n_rows in [1usize, 7, 301] {
                let seed = 1000 + i as u64 * 10 + n_rows as u64;
                let w = quantized_matrix(ty, n_rows, n_cols, seed);
                let mut act = ActBuf::new();
                act.prepare(ty, &values(seed + 99, n_cols, 1.0)).unwrap();
                let mut reference = vec![0f32; n_rows];
                dot_rows(ty, &w, n_cols, 0..n_rows, &act, &mut reference).unwrap();
                // Multi-row kernels (Q4_0's 8 rows) give each row the one-row kernel's bits.
                let row_bytes = w.len() / n_rows;
                for (r, v) in reference.iter().enumerate() {
                    let row = &w[r * row_bytes..(r + 1) * row_bytes];
                    let one = dot_row(table(ty).unwrap(), simd_level(), row, &act);
                    assert_eq!(one.to_bits(), v.to_bits(), "{ty} n_rows={n_rows} row {r}");
                }
                for pool in &pools {
                    let mut out = vec![f32::NAN; n_rows];
                    matvec(pool, ty, &w, n_rows, n_cols, &act, &mut out).unwrap();
                    let same = out
                        .iter()
                        .zip(&reference)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{ty} n_rows={n_rows} threads={} seed={seed}",
                        pool.n_threads()
                    );
                }
                // A sub-range of rows gives the same bits as the whole.
                if n_rows > 3 {
                    let mut part = vec![0f32; 3];
                    dot_rows(ty, &w, n_cols, 2..5, &act, &mut part).unwrap();
                    assert_eq!(&part[..], &reference[2..5], "{ty}");
                }
            }
        }
    }

    #[test]
    fn matmul_rows_equal_matvec_bits() {
        let pool = ThreadPool::new(2);
        for (i, (ty, n_cols)) in dot_types().into_iter().enumerate() {
            let n_rows = 131;
            let seed = 5000 + i as u64;
            let w = quantized_matrix(ty, n_rows, n_cols, seed);
            // Groups of 4 and a leftover, of 4 and 3 (or the lanes kernel: Q8_0 and Q4_K from
            // 6 tokens); 10 and 11 on either side of Q6_K's threshold; lanes kernels of 16
            // and 13 tokens (with groups and a leftover after them).
            for n_tokens in [5u64, 6, 7, 10, 11, 13, 21] {
                let acts: Vec<ActBuf> = (0..n_tokens)
                    .map(|t| {
                        let mut a = ActBuf::new();
                        a.prepare(ty, &values(seed * 7 + t, n_cols, 1.0)).unwrap();
                        a
                    })
                    .collect();
                let mut out = vec![f32::NAN; n_tokens as usize * n_rows];
                matmul(&pool, ty, &w, n_rows, n_cols, &acts, &mut out).unwrap();
                for (t, act) in acts.iter().enumerate() {
                    let mut one = vec![0f32; n_rows];
                    matvec(&pool, ty, &w, n_rows, n_cols, act, &mut one).unwrap();
                    let row = &out[t * n_rows..(t + 1) * n_rows];
                    assert!(
                        row.iter()
                            .zip(&one)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty} token {t} of {n_tokens} seed={seed}"
                    );
                }
            }
        }
    }

    #[test]
    fn one_round_of_products_gives_each_its_own_bits() {
        let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
        let types = dot_types();
        for (i, &(ty, n_cols)) in types.iter().enumerate() {
            // A second matrix of another type with the same activation format, when there is
            // one (Q4_K beside Q6_K: the FFN's gate and up of a mixed file), else the same.
            let ty2 = types
                .iter()
                .map(|&(t, _)| t)
                .find(|&t| {
                    t != ty
                        && ActFormat::for_weights(t) == ActFormat::for_weights(ty)
                        && t.block_size() == ty.block_size()
                })
                .unwrap_or(ty);
            let seed = 13000 + i as u64;
            // Row counts that split into uneven tasks, and an empty product.
            let shapes = [(ty, 301usize), (ty2, 67), (ty, 0), (ty2, 5)];
            let mats: Vec<Vec<u8>> = shapes
                .iter()
                .enumerate()
                .map(|(k, &(t, r))| quantized_matrix(t, r, n_cols, seed + 100 * k as u64))
                .collect();
            for n_tokens in [1usize, 6] {
                let acts: Vec<ActBuf> = (0..n_tokens)
                    .map(|t| {
                        let mut a = ActBuf::new();
                        a.prepare(ty, &values(seed * 5 + t as u64, n_cols, 1.0))
                            .unwrap();
                        a
                    })
                    .collect();
                for pool in &pools {
                    let mut outs: Vec<Vec<f32>> = shapes
                        .iter()
                        .map(|&(_, r)| vec![f32::NAN; r * n_tokens])
                        .collect();
                    let mut products: Vec<Product<'_, ActBuf>> = shapes
                        .iter()
                        .zip(&mats)
                        .zip(outs.iter_mut())
                        .map(|((&(t, r), w), out)| Product {
                            ty: t,
                            w,
                            n_rows: r,
                            n_cols,
                            acts: &acts,
                            out,
                        })
                        .collect();
                    matmul_round(pool, &mut products).unwrap();
                    for ((&(t, r), w), got) in shapes.iter().zip(&mats).zip(&outs) {
                        let mut want = vec![0f32; r * n_tokens];
                        matmul(pool, t, w, r, n_cols, &acts, &mut want).unwrap();
                        if n_tokens == 1 {
                            let mut one = vec![0f32; r];
                            matvec(pool, t, w, r, n_cols, &acts[0], &mut one).unwrap();
                            assert_eq!(want, one, "{t} matmul of one token == matvec");
                        }
                        assert!(
                            got.iter()
                                .zip(&want)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{t} ({r} rows, {n_tokens} tokens, {} threads)",
                            pool.n_threads()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_round_with_a_bad_product_computes_nothing() {
        let pool = ThreadPool::new(2);
        let (ty, n_cols) = (GgmlType::Q8_0, 64);
        let w = quantized_matrix(ty, 4, n_cols, 1);
        let mut act = ActBuf::new();
        act.prepare(ty, &values(2, n_cols, 1.0)).unwrap();
        let acts = [act];
        let (mut a, mut b) = (vec![f32::NAN; 4], vec![f32::NAN; 3]);
        let mut products = [
            Product {
                ty,
                w: &w,
                n_rows: 4,
                n_cols,
                acts: &acts,
                out: &mut a,
            },
            // 3 outputs for a 4-row matrix.
            Product {
                ty,
                w: &w,
                n_rows: 4,
                n_cols,
                acts: &acts,
                out: &mut b,
            },
        ];
        assert!(matches!(
            matmul_round(&pool, &mut products),
            Err(KernelError::Length { .. })
        ));
        assert!(a.iter().all(|v| v.is_nan()), "the good product ran");
    }

    #[test]
    fn batch_prepared_once_gives_the_per_row_bits() {
        let pools: Vec<ThreadPool> = (1..=2).map(ThreadPool::new).collect();
        for (i, (ty, n_cols)) in dot_types().into_iter().enumerate() {
            let n_rows = 37;
            let seed = 9000 + i as u64;
            let w = quantized_matrix(ty, n_rows, n_cols, seed);
            // Enough tokens to take the parallel path.
            let n_tokens = 64.max(8 * 1024 / n_cols + 1);
            let x: Vec<f32> = (0..n_tokens)
                .flat_map(|t| values(seed * 3 + t as u64, n_cols, 1.0))
                .collect();
            for pool in &pools {
                let mut batch = vec![ActBuf::new(); n_tokens];
                prepare_rows(pool, ty, &x, n_cols, &mut batch).unwrap();
                // An expert's rows: a subset, by reference, in any order.
                let pick: Vec<&ActBuf> = [5usize, 0, 63, 17, 18, 2, 40]
                    .iter()
                    .map(|&t| &batch[t])
                    .collect();
                let mut out = vec![f32::NAN; pick.len() * n_rows];
                matmul(pool, ty, &w, n_rows, n_cols, &pick, &mut out).unwrap();
                for (k, &t) in [5usize, 0, 63, 17, 18, 2, 40].iter().enumerate() {
                    let mut one = ActBuf::new();
                    one.prepare(ty, &x[t * n_cols..(t + 1) * n_cols]).unwrap();
                    let mut want = vec![0f32; n_rows];
                    matvec(pool, ty, &w, n_rows, n_cols, &one, &mut want).unwrap();
                    let got = &out[k * n_rows..(k + 1) * n_rows];
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty} token {t} threads {}",
                        pool.n_threads()
                    );
                }
            }
            // Wrong lengths are errors, and leave nothing half-prepared.
            let mut batch = vec![ActBuf::new(); 3];
            assert!(prepare_rows(&pools[0], ty, &x[..n_cols * 2], n_cols, &mut batch).is_err());
            assert!(batch.iter().all(|a| a.format().is_none()));
        }
    }

    #[test]
    fn bad_shapes_are_errors_not_panics() {
        let pool = ThreadPool::new(2);
        let ty = GgmlType::Q4_K;
        let w = quantized_matrix(ty, 4, 256, 1);
        let mut act = ActBuf::new();
        act.prepare(ty, &values(2, 256, 1.0)).unwrap();
        let mut out = vec![0f32; 4];
        // Weights one byte short.
        assert!(matches!(
            matvec(&pool, ty, &w[1..], 4, 256, &act, &mut out),
            Err(KernelError::Length { .. })
        ));
        // Output too short.
        assert!(matches!(
            matvec(&pool, ty, &w, 4, 256, &act, &mut out[..3]),
            Err(KernelError::Length { .. })
        ));
        // Columns not whole blocks.
        assert!(matches!(
            matvec(&pool, ty, &w, 4, 200, &act, &mut out),
            Err(KernelError::Blocks { .. })
        ));
        // Activation for another format, or another length.
        let mut act_q8 = ActBuf::new();
        act_q8
            .prepare(GgmlType::Q8_0, &values(2, 256, 1.0))
            .unwrap();
        assert!(matches!(
            matvec(&pool, ty, &w, 4, 256, &act_q8, &mut out),
            Err(KernelError::Activation { .. })
        ));
        assert!(matches!(
            matvec(&pool, ty, &w, 4, 256, &ActBuf::new(), &mut out),
            Err(KernelError::Activation { .. })
        ));
        // Rows out of range.
        assert!(matches!(
            dot_rows(ty, &w, 256, 3..5, &act, &mut out[..2]),
            Err(KernelError::Rows { .. })
        ));
        // Matmul output of the wrong size.
        assert!(matches!(
            matmul(&pool, ty, &w, 4, 256, &[act.clone()], &mut out[..3]),
            Err(KernelError::Length { .. })
        ));
        // Unsupported types.
        assert!(matches!(
            matvec(&pool, GgmlType::TQ1_0, &w, 4, 256, &act, &mut out),
            Err(KernelError::Unsupported { .. })
        ));
        assert!(matches!(
            ActBuf::new().prepare(GgmlType::IQ2_XS, &[0.0; 256]),
            Err(KernelError::Unsupported { .. })
        ));
        assert!(matches!(
            act.prepare(GgmlType::Q4_K, &[0.0; 100]),
            Err(KernelError::Blocks { .. })
        ));
        // A failed prepare leaves the buffer unusable rather than stale.
        assert!(act.format().is_none());
        let mut q = vec![0u8; 144];
        assert!(matches!(
            quantize_row(GgmlType::Q4_K, &[0.0; 256], &mut q[..143]),
            Err(KernelError::Length { .. })
        ));
        assert!(matches!(
            dequantize_row(GgmlType::Q4_K, &q, &mut [0.0; 255]),
            Err(KernelError::Blocks { .. })
        ));
        assert!(matches!(
            quantize_row(GgmlType::IQ2_XS, &[0.0; 256], &mut q),
            Err(KernelError::Unsupported { .. })
        ));
    }

    #[test]
    fn random_weight_bytes_do_not_panic() {
        // Weights straight from an untrusted file: any bytes must give some number, no panic,
        // and the same number at every SIMD level.
        for (ty, n_cols) in dot_types() {
            let row_bytes = ty.row_bytes(n_cols as u64).unwrap() as usize;
            let w = bytes(77, 3 * row_bytes);
            let mut act = ActBuf::new();
            act.prepare(ty, &values(78, n_cols, 1.0)).unwrap();
            let mut back = vec![0f32; n_cols];
            dequantize_row(ty, &w[..row_bytes], &mut back).unwrap();
            for r in 0..3 {
                let row = &w[r * row_bytes..(r + 1) * row_bytes];
                let results: Vec<f32> = SimdLevel::available()
                    .into_iter()
                    .map(|l| dot_row(table(ty).unwrap(), l, row, &act))
                    .collect();
                for v in &results[1..] {
                    assert!(
                        v.to_bits() == results[0].to_bits() || (v.is_nan() && results[0].is_nan()),
                        "{ty}: {results:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = f16_to_f32(bits.to_le_bytes());
            assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
        }
        #[cfg(target_arch = "x86_64")]
        if simd_level() >= SimdLevel::Avx2 {
            use std::arch::x86_64::*;
            for bits in 0..=u16::MAX {
                // SAFETY: F16C is present (the AVX2 level requires it).
                let hw = unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))) };
                assert_eq!(
                    f16_to_f32(bits.to_le_bytes()).to_bits(),
                    hw.to_bits(),
                    "{bits:#06x}"
                );
            }
        }
    }

    #[test]
    fn nearest_int_is_round_ties_even() {
        let mut vals = vec![0.0f32, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -127.5];
        vals.extend([
            4_194_303.5,
            -4_194_303.5,
            4_194_304.0,
            8_388_609.0,
            1e30,
            -1e30,
        ]);
        vals.extend([
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
        ]);
        // Every half step and its neighbouring floats up to ±300, and a pseudo-random spread.
        for h in -600..=600 {
            let v = h as f32 * 0.5;
            vals.extend([
                v,
                f32::from_bits(v.to_bits() + 1),
                f32::from_bits(v.to_bits().wrapping_sub(1)),
            ]);
        }
        let mut x = 0x1234_5678u32;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            vals.push(f32::from_bits(x));
            vals.push((x as f32 / u32::MAX as f32 - 0.5) * 600.0);
        }
        for v in vals {
            assert_eq!(
                nearest_int(v),
                v.round_ties_even() as i32,
                "{v:e} ({:#x})",
                v.to_bits()
            );
        }
    }

    #[test]
    fn reductions_follow_their_trees() {
        let l8: [f32; 8] = [1e8, 1.0, -1e8, 1.0, 3.0, 0.5, 0.25, 0.125];
        assert_eq!(
            reduce8(&l8),
            ((1e8f32 + 3.0) + (-1e8 + 0.25)) + ((1.0 + 0.5) + (1.0 + 0.125))
        );
        let mut l32 = [0f32; 32];
        for (i, v) in l32.iter_mut().enumerate() {
            *v = i as f32;
        }
        assert_eq!(reduce32(&l32), 496.0);
    }
}
