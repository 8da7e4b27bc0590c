//! Seeded random data and the checks every format's tests make, written once.
//!
//! Why this exists: every format's tests are the same three-way test (SIMD vs scalar bits,
//! scalar vs the dequantized f64 dot, scalar vs the unquantized f64 dot within the activation's
//! error budget), the grouped-vs-single dot check and the llama.cpp row check, differing only
//! in the format, seeds and budgets. A format is named by its [`Format`] type; the loops and
//! assertions live here.

use super::format::{Activation, Format, FormatTable};
use super::q8_0::{self, BlockQ8_0};
use super::q8_k::{self, BlockQ8K, GROUP, WIDE};
use super::{dequantize_row, dot_row, quantize_row, ActBuf, ActFormat, SimdLevel};
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

/// Q8_0 blocks of `x` by the reference (weight) quantizer.
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

/// `x` prepared for dot products with `ty` weights, as the forward pass prepares it.
pub fn prepared(ty: GgmlType, x: &[f32]) -> ActBuf {
    let mut buf = ActBuf::new();
    buf.prepare(ty, x).expect("a weight type and whole blocks");
    buf
}

/// The values a prepared quantized activation stands for, and its quantizer's error bound on
/// one value relative to its block's absmax; `None` for the float forms.
pub fn act_values(act: &ActBuf) -> Option<(Vec<f32>, usize, f64)> {
    match act.format()? {
        ActFormat::Q8_0 => {
            let mut out = vec![0f32; act.q8_0.blocks.len() * q8_0::QK];
            q8_0::dequantize(&act.q8_0.blocks, &mut out);
            // Rounding (amax/254) plus the f16 scale's rounding (amax·2^-11), with slack.
            Some((out, q8_0::QK, (1.0 / 254.0 + 1.0 / 2048.0) * 1.001))
        }
        ActFormat::Q8K => {
            let mut out = vec![0f32; act.q8_k.len() * q8_k::QK_K];
            q8_k::dequantize(&act.q8_k, &mut out);
            // Rounding only (Q8_K keeps an f32 scale), with slack.
            Some((out, q8_k::QK_K, 1.0001 / 254.0))
        }
        ActFormat::F32 | ActFormat::F16 | ActFormat::Bf16 => None,
    }
}

/// The table of format `F`.
pub fn table_of<F: Format>() -> &'static FormatTable {
    super::table(F::TY).expect("a registered format")
}

/// `F`'s scalar reference dot on row bytes.
pub fn scalar_dot<F: Format>(w: &[u8], act: &ActBuf) -> f32 {
    F::dot(super::blocks(w), F::Act::view(act))
}

/// SIMD vs scalar: for each `(seed, n_blocks)`, weights from `values(seed, .., 0.1)` and the
/// activation from `values(seed + act_seed_offset, .., 1.0)`; every available level must give
/// exactly the scalar bits. Then the same on random weight bytes (a file we do not trust: any
/// scale, any nibble), where NaN payloads are not pinned.
pub fn check_simd_matches_scalar<F: Format>(cases: &[(u64, usize)], act_seed_offset: u64) {
    for &(seed, n_blocks) in cases {
        let n = n_blocks * F::TY.block_size() as usize;
        let act = prepared(F::TY, &values(seed + act_seed_offset, n, 1.0));
        let quantized = quantized_bytes(F::TY, &values(seed, n, 0.1));
        let random = bytes(seed ^ 0x5eed, quantized.len());
        for (what, w) in [("quantized", &quantized), ("random", &random)] {
            let s = scalar_dot::<F>(w, &act);
            for level in SimdLevel::available() {
                let got = dot_row(table_of::<F>(), level, w, &act);
                assert!(
                    got.to_bits() == s.to_bits() || (got.is_nan() && s.is_nan()),
                    "{} {level:?} {what} seed={seed} n={n}: {got} vs scalar {s}",
                    F::TY
                );
            }
        }
    }
}

/// Scalar vs two f64 references for a quantized format, per seed (4096 values): the dot of
/// the dequantized weights and dequantized activation ([`assert_matches_dequantized`]), and
/// the dot with the unquantized activation, within the activation quantizer's error
/// ([`act_error_bound`]) plus float rounding of the block terms and the accumulator chain.
pub fn check_scalar_against_references<F: Format>(seeds: &[u64]) {
    for &seed in seeds {
        let n = 4096;
        let wq = quantized_bytes(F::TY, &values(seed, n, 0.1));
        let w = dequantized(F::TY, &wq);
        let a = values(seed + 7, n, 1.0);
        let act = prepared(F::TY, &a);
        let (a_deq, block, rel) = act_values(&act).expect("a quantized activation");
        let got = scalar_dot::<F>(&wq, &act);
        assert_matches_dequantized(got, &w, &a_deq, &format!("{} seed={seed}", F::TY));
        // Against the unquantized activation: the activation's rounding error.
        let got = got as f64;
        let bound =
            act_error_bound(&w, &a, block, rel) + abs_dot_f64(&w, &a) * 64.0 * f32::EPSILON as f64;
        let err = (got - dot_f64(&w, &a)).abs();
        assert!(
            err <= bound,
            "{} seed={seed} err={err} bound={bound}",
            F::TY
        );
    }
}

/// Scalar vs the f64 reference for a float format (4096 values, seeds 11/12): within the
/// activation's conversion error (`act_rel` relative) plus one rounding per product and per
/// add along the lanes' chain of n/32 + 5 adds.
pub fn check_float_scalar_against_reference<F: Format>(act_rel: f64) {
    let n = 4096;
    let wb = quantized_bytes(F::TY, &values(11, n, 0.1));
    let w = dequantized(F::TY, &wb);
    let a = values(12, n, 1.0);
    let got = scalar_dot::<F>(&wb, &prepared(F::TY, &a)) as f64;
    let rel = act_rel + ((n / 32 + 6) as f64) * f32::EPSILON as f64;
    let bound = abs_dot_f64(&w, &a) * rel;
    assert!(
        (got - dot_f64(&w, &a)).abs() <= bound,
        "{} seed 11/12",
        F::TY
    );
}

/// Every level's grouped dot gives, for each of its activations (1 to [`GROUP`] of them),
/// exactly the bits of the single dot; `expect_grouped` says whether the best level has a
/// grouped kernel.
pub fn check_group_matches_single<F: Format>(expect_grouped: bool) {
    let n = 5 * F::TY.block_size() as usize;
    // 7 rows (kernels taking 4, 2 and 1 rows at a time): quantized ones and untrusted bytes
    // (any scale, any level).
    let row_bytes = quantized_bytes(F::TY, &values(70, n, 0.1)).len();
    let w: Vec<u8> = (0..7u64)
        .flat_map(|r| {
            if r % 2 == 0 {
                quantized_bytes(F::TY, &values(70 + r, n, 0.1))
            } else {
                bytes(0x6a0 + r, row_bytes)
            }
        })
        .collect();
    let n_rows = 7;
    let t = table_of::<F>();
    assert_eq!(
        t.at(super::simd_level()).group.is_some(),
        expect_grouped && super::simd_level() > SimdLevel::Scalar,
        "{}",
        F::TY
    );
    let mut acts: Vec<ActBuf> = (0..WIDE as u64)
        .map(|t| prepared(F::TY, &values(71 + t, n, 1.0)))
        .collect();
    for round in 0..2 {
        if round == 1 {
            // The same buffers prepared again with other values, and the widest call first:
            // a lanes kernel must repack rather than reuse what it packed from the old ones.
            for (k, a) in acts.iter_mut().enumerate() {
                a.prepare(F::TY, &values(171 + k as u64, n, 1.0)).unwrap();
            }
        }
        check_groups_once::<F>(&w, row_bytes, n_rows, &acts, round == 1);
    }
}

/// One pass of [`check_group_matches_single`] over every level, kernel, width and row step
/// (widths widest first when `widest_first`).
fn check_groups_once<F: Format>(
    w: &[u8],
    row_bytes: usize,
    n_rows: usize,
    acts: &[ActBuf],
    widest_first: bool,
) {
    let t = table_of::<F>();
    for level in SimdLevel::available() {
        let fns = t.at(level);
        let kernels = [(fns.group, GROUP), (fns.wide, WIDE)];
        for (g, max) in kernels.into_iter().filter_map(|(g, m)| g.map(|g| (g, m))) {
            let widths: Vec<usize> = if widest_first {
                (1..=max).rev().collect()
            } else {
                (1..=max).collect()
            };
            for width in widths {
                for rows in [0..n_rows, 2..3, 1..4] {
                    let group: Vec<&ActBuf> = acts[..width].iter().collect();
                    let mut got = vec![vec![f32::NAN; rows.len()]; width];
                    let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|o| &mut o[..]).collect();
                    // SAFETY: the level is available; `rows` lie inside `w`.
                    unsafe { g(w, row_bytes, rows.clone(), &group, &mut outs) };
                    for k in 0..width {
                        for (i, r) in rows.clone().enumerate() {
                            let row = &w[r * row_bytes..(r + 1) * row_bytes];
                            let single = dot_row(t, level, row, &acts[k]);
                            let v = got[k][i];
                            assert!(
                                v.to_bits() == single.to_bits() || (v.is_nan() && single.is_nan()),
                                "{} {level:?} width {width} rows {rows:?} token {k} row {r}: \
                                 {v} vs {single}",
                                F::TY
                            );
                        }
                    }
                }
            }
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
        let act = prepared(ty, &case.act);
        for level in SimdLevel::available() {
            let got = dot_row(super::table(ty).unwrap(), level, &case.row, &act);
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

/// CPU time of the calling thread (robust to being descheduled on a shared machine), seconds.
pub fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Tuning aid: nanoseconds of thread CPU time per (super-block, token) of `F`'s grouped and
/// single dots at every level, on a 128-row × 2048-column matrix in L2 (best of 7 passes).
pub fn print_group_speed<F: Format>() {
    let (n_rows, n_cols) = (128usize, 2048usize);
    let nb = n_cols / F::TY.block_size() as usize;
    let w: Vec<u8> = (0..n_rows)
        .flat_map(|r| quantized_bytes(F::TY, &values(300 + r as u64, n_cols, 0.1)))
        .collect();
    let row_bytes = w.len() / n_rows;
    let acts: Vec<ActBuf> = (0..WIDE as u64)
        .map(|t| prepared(F::TY, &values(400 + t, n_cols, 1.0)))
        .collect();
    let t = table_of::<F>();
    let mut out = vec![vec![0f32; n_rows]; WIDE];
    for level in SimdLevel::available() {
        if level == SimdLevel::Scalar {
            continue;
        }
        let f = t.at(level);
        let mut line = format!("{} {:?} ({:?})", F::TY, level, f.level);
        // Width 0 is the one-token dot; then the grouped kernel at 1..=GROUP tokens, then the
        // lanes kernel at every width it takes, so the thresholds can be read off one run.
        let runs = (0..=GROUP)
            .map(|w| (w, false))
            .chain((2..=WIDE).map(|w| (w, true)));
        for (width, lanes) in runs {
            let kernel = if width == 0 {
                None
            } else if lanes {
                f.wide
            } else {
                f.group
            };
            if width > 0 && kernel.is_none() {
                continue;
            }
            let mut best = f64::MAX;
            for _ in 0..7 {
                let t0 = thread_cpu_s();
                for _ in 0..20 {
                    // SAFETY: the level is available; rows lie inside `w`.
                    unsafe {
                        if let Some(g) = kernel {
                            let group: Vec<&ActBuf> = acts[..width].iter().collect();
                            let mut outs: Vec<&mut [f32]> =
                                out.iter_mut().take(width).map(|o| &mut o[..]).collect();
                            g(&w, row_bytes, 0..n_rows, &group, &mut outs);
                        } else {
                            (f.rows)(&w, row_bytes, 0..n_rows, &acts[0], &mut out[0]);
                        }
                    }
                }
                best = best.min(thread_cpu_s() - t0);
            }
            let per = best * 1e9 / (20 * n_rows * nb * width.max(1)) as f64;
            line += &format!(
                "  {}: {per:.1}",
                match (width, lanes) {
                    (0, _) => "single".to_string(),
                    (_, false) => format!("g{width}"),
                    (_, true) => format!("L{width}"),
                }
            );
        }
        println!("{line}");
    }
    std::hint::black_box(&out);
}
