//! Seeded random data and the checks every format's tests make, written once.
//!
//! Why this exists: each format file used to carry its own copy of the same three-way test
//! (SIMD vs scalar bits, scalar vs the dequantized f64 dot, scalar vs the unquantized f64 dot
//! within the activation's error budget), the grouped-vs-single dot check and the llama.cpp row
//! check, differing only in types, seeds and budgets. A format now describes itself once
//! ([`DotKernel`]) and states its seeds and budgets; the loops and assertions live here.

use super::q8_0::{self, BlockQ8_0};
use super::q8_k::{self, BlockQ8K, GROUP};
use super::{dequantize_row, dot_row, quantize_row, ActBuf, SimdLevel};
use crate::gguf::GgmlType;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `n` values, roughly Gaussian (sum of uniforms), scaled by `scale`, plus a few outliers
/// like real weights and activations have.
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let g: f32 = (0..4).map(|_| rng.gen_range(-1.0f32..1.0)).sum::<f32>() * 0.866;
            let v = g * scale;
            if rng.gen_range(0..64) == 0 {
                v * 6.0
            } else {
                v
            }
        })
        .collect()
}

/// Random bytes (weights straight from a file we do not trust).
pub fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen()).collect()
}

/// f64 dot product, the reference.
pub fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Σ|a·b| in f64, the scale of a dot product's rounding error.
pub fn abs_dot_f64(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 * *y as f64).abs())
        .sum()
}

/// Root-mean-square of `v`.
pub fn rms(v: &[f32]) -> f64 {
    (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
}

/// Checks a kernel's dot against the f64 dot of the dequantized weights and dequantized
/// activation: they differ only by f32 rounding — a few dozen roundings of terms no larger
/// than a few Σ|w·a| — so 1e-4 · Σ|w·a| is generous, yet far below the error any wrong bit
/// layout would make.
pub fn assert_matches_dequantized(got: f32, w: &[f32], a: &[f32], what: &str) {
    let want = dot_f64(w, a);
    let bound = 1e-4 * abs_dot_f64(w, a);
    let err = (got as f64 - want).abs();
    assert!(
        err <= bound,
        "{what}: kernel {got} vs dequantized {want} (bound {bound})"
    );
}

/// Six standard deviations of the error an activation quantizer puts into a dot product
/// when its error on each value is independent and at most `amax(block) · rel` (uniform:
/// σ_i = amax · rel / √3). A statistical bound, but a fixed-seed test either always passes
/// or always fails, and a wrong layout misses it by orders of magnitude.
pub fn act_error_bound(w: &[f32], a: &[f32], block: usize, rel: f64) -> f64 {
    let var: f64 = w
        .chunks(block)
        .zip(a.chunks(block))
        .map(|(wb, ab)| {
            let amax = ab.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
            let sigma = amax * rel / 3f64.sqrt();
            wb.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() * sigma * sigma
        })
        .sum();
    6.0 * var.sqrt()
}

/// One row of `x` quantized to `ty` (through [`quantize_row`]), as bytes.
pub fn quantized_bytes(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let row_bytes = ty.row_bytes(x.len() as u64).expect("whole blocks") as usize;
    let mut b = vec![0u8; row_bytes];
    quantize_row(ty, x, &mut b).expect("a type with a quantizer");
    b
}

/// A `ty` row expanded back to f32 (through [`dequantize_row`]). The output starts as NaN, so
/// a value the dequantizer does not write fails every comparison.
pub fn dequantized(ty: GgmlType, row: &[u8]) -> Vec<f32> {
    let n = row.len() / ty.type_size() as usize * ty.block_size() as usize;
    let mut out = vec![f32::NAN; n];
    dequantize_row(ty, row, &mut out).expect("a type with a quantizer");
    out
}

/// `x` quantized to `ty` and expanded back.
pub fn round_trip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    dequantized(ty, &quantized_bytes(ty, x))
}

/// `rms(x − round_trip(x)) / rms(x)`.
pub fn relative_rms_error(ty: GgmlType, x: &[f32]) -> f64 {
    let diff: Vec<f32> = x
        .iter()
        .zip(round_trip(ty, x))
        .map(|(p, q)| p - q)
        .collect();
    rms(&diff) / rms(x)
}

/// Q8_0 blocks of `x` by the reference (weight) quantizer, the activation the Q4_0 and Q8_0
/// tests dot with.
pub fn q8_0_blocks(x: &[f32]) -> Vec<BlockQ8_0> {
    let mut b = vec![BlockQ8_0::ZERO; x.len() / q8_0::QK];
    q8_0::quantize(x, &mut b);
    b
}

/// Q8_K blocks of `x`, the activation the K-quant tests dot with.
pub fn q8_k_blocks(x: &[f32]) -> Vec<BlockQ8K> {
    let mut b = vec![BlockQ8K::ZERO; x.len() / q8_k::QK_K];
    q8_k::quantize(x, &mut b);
    b
}

/// The 16-bit activation bits [`ActBuf::prepare`] makes for F16 or BF16 weights.
pub fn act_u16(ty: GgmlType, x: &[f32]) -> Vec<u16> {
    let mut buf = ActBuf::new();
    buf.prepare(ty, x).expect("an F16 or BF16 type");
    buf.u16s.clone()
}

/// A format's one-row dot as the shared checks drive it: weights are the row bytes
/// [`quantized_bytes`] makes for [`DotKernel::TY`]; `dot` and `dot_scalar` are the format's
/// own kernel entry points on them.
pub trait DotKernel {
    /// The weight type.
    const TY: GgmlType;
    /// The activation the kernel takes.
    type Act;
    /// The activation for f32 values `x`.
    fn act(x: &[f32]) -> Self::Act;
    /// The kernel at `level`.
    fn dot(level: SimdLevel, w: &[u8], a: &Self::Act) -> f32;
    /// The scalar reference.
    fn dot_scalar(w: &[u8], a: &Self::Act) -> f32;
}

/// A quantized activation format: its block, the relative error bound of its quantizer per
/// value (of the block's absmax) and its dequantizer.
pub trait QuantAct {
    /// Values per block.
    const BLOCK: usize;
    /// The quantizer's error bound on one value, relative to its block's absmax.
    const REL: f64;
    /// The values the blocks stand for.
    fn dequantize(&self) -> Vec<f32>;
}

impl QuantAct for Vec<BlockQ8_0> {
    const BLOCK: usize = q8_0::QK;
    // Rounding (amax/254) plus the f16 scale's rounding (amax·2^-11), with slack.
    const REL: f64 = (1.0 / 254.0 + 1.0 / 2048.0) * 1.001;
    fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len() * q8_0::QK];
        q8_0::dequantize(self, &mut out);
        out
    }
}

impl QuantAct for Vec<BlockQ8K> {
    const BLOCK: usize = q8_k::QK_K;
    // Rounding only (Q8_K keeps an f32 scale), with slack.
    const REL: f64 = 1.0001 / 254.0;
    fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len() * q8_k::QK_K];
        q8_k::dequantize(self, &mut out);
        out
    }
}

/// A K-quant format's multi-token dot ([`GROUP`] Q8_K activations at once).
pub trait GroupDotKernel: DotKernel<Act = Vec<BlockQ8K>> {
    /// The grouped kernel at `level`.
    fn dot_group(level: SimdLevel, w: &[u8], a: [&[BlockQ8K]; GROUP]) -> [f32; GROUP];
}

/// Declares unit struct `$name` as the [`DotKernel`] (and with `group`, the [`GroupDotKernel`])
/// of the calling format module, over that module's own `dot`, `dot_scalar` (and `dot_group`),
/// with weight rows viewed as the module's blocks (`blocks`) or taken as bytes (`bytes`, the
/// float formats). `$act` makes the activation from f32 values.
macro_rules! dot_kernel {
    ($name:ident, $ty:ident, $act_ty:ty, $act:expr, bytes $(, $group:ident)?) => {
        dot_kernel!(@ $name, $ty, $act_ty, $act, $crate::kernels::testutil::as_bytes $(, $group)?);
    };
    ($name:ident, $ty:ident, $act_ty:ty, $act:expr, blocks $(, $group:ident)?) => {
        dot_kernel!(@ $name, $ty, $act_ty, $act, $crate::kernels::blocks $(, $group)?);
    };
    (@ $name:ident, $ty:ident, $act_ty:ty, $act:expr, $view:path) => {
        struct $name;
        impl DotKernel for $name {
            const TY: GgmlType = GgmlType::$ty;
            type Act = $act_ty;
            fn act(x: &[f32]) -> $act_ty {
                ($act)(x)
            }
            fn dot(level: SimdLevel, w: &[u8], a: &$act_ty) -> f32 {
                dot(level, $view(w), a)
            }
            fn dot_scalar(w: &[u8], a: &$act_ty) -> f32 {
                dot_scalar($view(w), a)
            }
        }
    };
    (@ $name:ident, $ty:ident, $act_ty:ty, $act:expr, $view:path, group) => {
        dot_kernel!(@ $name, $ty, $act_ty, $act, $view);
        impl GroupDotKernel for $name {
            fn dot_group(level: SimdLevel, w: &[u8], a: [&[BlockQ8K]; GROUP]) -> [f32; GROUP] {
                dot_group(level, $view(w), a)
            }
        }
    };
}
pub(crate) use dot_kernel;

/// Weight rows taken as they are (the float formats' kernels read bytes).
pub fn as_bytes(w: &[u8]) -> &[u8] {
    w
}

/// SIMD vs scalar: for each `(seed, n_blocks)`, weights from `values(seed, .., 0.1)` and the
/// activation from `values(seed + act_seed_offset, .., 1.0)`; every available level must give
/// exactly the scalar bits.
pub fn check_simd_matches_scalar<K: DotKernel>(cases: &[(u64, usize)], act_seed_offset: u64) {
    for &(seed, n_blocks) in cases {
        let n = n_blocks * K::TY.block_size() as usize;
        let w = quantized_bytes(K::TY, &values(seed, n, 0.1));
        let a = K::act(&values(seed + act_seed_offset, n, 1.0));
        let s = K::dot_scalar(&w, &a);
        for level in SimdLevel::available() {
            assert_eq!(
                K::dot(level, &w, &a).to_bits(),
                s.to_bits(),
                "{} {level:?} seed={seed} n={n}",
                K::TY
            );
        }
    }
}

/// Scalar vs two f64 references for a quantized format, per seed (4096 values): the dot of
/// the dequantized weights and dequantized activation ([`assert_matches_dequantized`]), and
/// the dot with the unquantized activation, within the activation quantizer's error
/// ([`act_error_bound`]) plus float rounding of the block terms and the accumulator chain.
pub fn check_scalar_against_references<K: DotKernel>(seeds: &[u64])
where
    K::Act: QuantAct,
{
    for &seed in seeds {
        let n = 4096;
        let wq = quantized_bytes(K::TY, &values(seed, n, 0.1));
        let w = dequantized(K::TY, &wq);
        let a = values(seed + 7, n, 1.0);
        let aq = K::act(&a);
        let a_deq = aq.dequantize();
        let got = K::dot_scalar(&wq, &aq);
        assert_matches_dequantized(got, &w, &a_deq, &format!("{} seed={seed}", K::TY));
        // Against the unquantized activation: the activation's rounding error.
        let got = got as f64;
        let bound = act_error_bound(&w, &a, K::Act::BLOCK, K::Act::REL)
            + abs_dot_f64(&w, &a) * 64.0 * f32::EPSILON as f64;
        let err = (got - dot_f64(&w, &a)).abs();
        assert!(
            err <= bound,
            "{} seed={seed} err={err} bound={bound}",
            K::TY
        );
    }
}

/// Scalar vs the f64 reference for a float format (4096 values, seeds 11/12): within the
/// activation's conversion error (`act_rel` relative) plus one rounding per product and per
/// add along the lanes' chain of n/32 + 5 adds.
pub fn check_float_scalar_against_reference<K: DotKernel>(act_rel: f64) {
    let n = 4096;
    let wb = quantized_bytes(K::TY, &values(11, n, 0.1));
    let w = dequantized(K::TY, &wb);
    let a = values(12, n, 1.0);
    let got = K::dot_scalar(&wb, &K::act(&a)) as f64;
    let rel = act_rel + ((n / 32 + 6) as f64) * f32::EPSILON as f64;
    let bound = abs_dot_f64(&w, &a) * rel;
    assert!(
        (got - dot_f64(&w, &a)).abs() <= bound,
        "{} seed 11/12",
        K::TY
    );
}

/// The grouped dot gives, for each of its [`GROUP`] activations, exactly the bits of the
/// single dot, at every level.
pub fn check_group_matches_single<K: GroupDotKernel>() {
    let n = 5 * q8_k::QK_K;
    let w = quantized_bytes(K::TY, &values(70, n, 0.1));
    let acts: Vec<Vec<BlockQ8K>> = (0..GROUP as u64)
        .map(|t| K::act(&values(71 + t, n, 1.0)))
        .collect();
    let group: [&[BlockQ8K]; GROUP] = std::array::from_fn(|t| acts[t].as_slice());
    for level in SimdLevel::available() {
        let got = K::dot_group(level, &w, group);
        for t in 0..GROUP {
            assert_eq!(
                got[t].to_bits(),
                K::dot(level, &w, &acts[t]).to_bits(),
                "{} {level:?} t={t}",
                K::TY
            );
        }
    }
}

/// Rows llama.cpp computed, from f32 activations prepared as the forward pass prepares them
/// ([`ActBuf::prepare`], so the activation quantizer is covered too): the dot must give
/// llama.cpp's bits at every SIMD level. `file` holds `n_cases` rows.
pub fn check_llama_rows(ty: GgmlType, file: &[u8], n_cases: usize) {
    let cases = llama_rows(file);
    assert_eq!(cases.len(), n_cases);
    for (i, case) in cases.iter().enumerate() {
        let mut act = ActBuf::new();
        act.prepare(ty, &case.act).unwrap();
        for level in SimdLevel::available() {
            let got = dot_row(ty, level, &case.row, &act);
            assert_eq!(
                got.to_bits(),
                case.expected.to_bits(),
                "{ty} case {i} {level:?}: {got} vs llama.cpp {}",
                case.expected
            );
        }
    }
}

/// One weight row, the f32 activation llama.cpp multiplied it with, and llama.cpp's result.
pub struct LlamaRow {
    pub row: Vec<u8>,
    pub act: Vec<f32>,
    pub expected: f32,
}

/// Parses a `testdata/llama_rows_*.bin` file (layout in `testdata/make_llama_rows.py`):
/// rows and results recorded from llama.cpp's CPU backend (llama-cpp-python 0.3.36 on an
/// x86-64 AVX-512 machine) where bmoe's previous summation order gave other bits.
pub fn llama_rows(b: &[u8]) -> Vec<LlamaRow> {
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let f32_at = |o: usize| f32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let mut o = 4;
    (0..u32_at(0))
        .map(|_| {
            let (n_cols, n_bytes) = (u32_at(o), u32_at(o + 4));
            o += 8;
            let row = b[o..o + n_bytes].to_vec();
            o += n_bytes;
            let act = (0..n_cols).map(|i| f32_at(o + 4 * i)).collect();
            o += 4 * n_cols;
            let expected = f32_at(o);
            o += 4;
            LlamaRow { row, act, expected }
        })
        .collect()
}
