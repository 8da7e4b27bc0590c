//! Our kernels against llama.cpp's own on the same blocks, for every weight format the kernels
//! take (scripts/ggml_ref.py: ctypes into the ggml libraries PyPI `llama-cpp-python` ships, with
//! the PyPI `gguf` package's dequantizer as a second opinion):
//! - dequantization is bit-identical on blocks from our quantizer, from llama.cpp's quantizer
//!   (what `llama-quantize` writes) and on random bytes (any scale, any index);
//! - our dot product of those blocks with an activation equals llama.cpp's `vec_dot` of them
//!   with its own quantization of the same activation: bit for bit where our summation order
//!   is llama.cpp's x86 one ([`EXACT`]), within float rounding elsewhere.
//!
//! The third way, our SIMD path against our scalar reference bit for bit, is each format's unit
//! test (`engine/src/kernels/<format>.rs`). Skips with a message when python3 or the packages
//! are missing, except under `CI=true`.

use super::common::*;
use bmoe_engine::gguf::GgmlType;
use bmoe_engine::kernels::{self, ActBuf, SimdLevel, ThreadPool};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::Path;
use std::process::Command;

/// Values per row: a multiple of every block size, and more than one 256-value super-block.
const N: usize = 512;
/// Rows per source of blocks.
const ROWS: usize = 6;

/// Formats whose dot follows the order of llama.cpp's x86 `ggml_vec_dot_*` and its activation
/// quantizer exactly, so each row's result must be its bits (on an AVX2 machine, where
/// llama.cpp runs those paths). Q4_0 and Q4_K follow the order of its repacked kernels
/// (`q4_0_8x8`, `q4_K_8x8`) instead, the ones its CPU backend runs for them on x86, so their
/// `vec_dot` differs in the last bits; golden rows from a llama.cpp run pin those
/// (`engine/src/kernels/testdata`).
const EXACT: &[GgmlType] = &[
    GgmlType::Q8_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
];

fn python_ready() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import gguf, llama_cpp, numpy"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        if in_ci() {
            panic!("CI=true but python3 with gguf, llama_cpp and numpy is missing (scripts/test.sh installs them)");
        }
        eprintln!("skipping: python3 with gguf, llama-cpp-python and numpy is not available (pip install -r scripts/requirements-test.txt)");
    }
    ok
}

fn write_f32(path: &Path, v: &[f32]) {
    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(path, b).expect("write f32 file");
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .expect("read f32 file")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Bell-shaped values with a few outliers, like weights.
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let g: f32 = (0..4).map(|_| rng.gen_range(-1.0f32..1.0)).sum::<f32>() * 0.866;
            if rng.gen_range(0..64) == 0 {
                g * scale * 6.0
            } else {
                g * scale
            }
        })
        .collect()
}

fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Our rows of `ty` for `x` (`ROWS` rows of `N`).
fn ours(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let row_bytes = ty.row_bytes(N as u64).unwrap() as usize;
    let mut out = vec![0u8; ROWS * row_bytes];
    for (r, o) in x.chunks(N).zip(out.chunks_mut(row_bytes)) {
        kernels::quantize_row(ty, r, o).unwrap();
    }
    out
}

fn dequantize(ty: GgmlType, raw: &[u8]) -> Vec<f32> {
    let n = raw.len() / ty.type_size() as usize * ty.block_size() as usize;
    let mut out = vec![f32::NAN; n];
    kernels::dequantize_row(ty, raw, &mut out).unwrap();
    out
}

#[test]
fn every_format_matches_llama_cpp_on_the_same_blocks() {
    if !python_ready() {
        return;
    }
    let dir = scratch("llama-kernels");
    let x = values(1, ROWS * N, 0.05);
    let a = values(2, N, 1.0);
    write_f32(&dir.join("x.f32"), &x);
    write_f32(&dir.join("a.f32"), &a);
    let types = kernels::weight_types();
    let mut jobs = Vec::new();
    for &ty in types {
        let name = ty.name();
        let p = |s: &str| dir.join(format!("{name}.{s}")).display().to_string();
        let row_bytes = ty.row_bytes(N as u64).unwrap() as usize;
        std::fs::write(p("ours"), ours(ty, &x)).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(3 + ty.id() as u64);
        let random: Vec<u8> = (0..ROWS * row_bytes).map(|_| rng.gen()).collect();
        std::fs::write(p("random"), random).unwrap();
        jobs.push(
            serde_json::json!({"op": "quantize", "type": name, "in": dir.join("x.f32"),
            "n_per_row": N, "out": p("llama")}),
        );
        for src in ["ours", "random", "llama"] {
            jobs.push(
                serde_json::json!({"op": "dequantize", "type": name, "in": p(src),
                "out": p(&format!("{src}.deq"))}),
            );
        }
        for src in ["ours", "llama"] {
            jobs.push(serde_json::json!({"op": "dot", "type": name, "in": p(src),
                "n_per_row": N, "x": dir.join("a.f32"), "out": p(&format!("{src}.dot"))}));
        }
    }
    let jobs_path = dir.join("jobs.json");
    std::fs::write(&jobs_path, serde_json::to_vec(&jobs).unwrap()).unwrap();
    let script = bmoe_engine::testdata::project_root().join("scripts/ggml_ref.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg("batch")
        .arg(&jobs_path)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "ggml_ref.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let pool = ThreadPool::new(1);
    // The rows are llama.cpp's x86 CPU backend's: where it ran its AVX2 paths our documented
    // orders are its own (an aarch64 build of these tests compares with no x86 run).
    #[cfg(target_arch = "x86_64")]
    let avx2 = kernels::simd_level() >= SimdLevel::Avx2;
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = false;
    let mut failures = Vec::new();
    for &ty in types {
        let name = ty.name();
        let p = |s: &str| dir.join(format!("{name}.{s}"));
        // Dequantization: bit for bit, whoever made the blocks.
        for src in ["ours", "random", "llama"] {
            let raw = std::fs::read(p(src)).unwrap();
            let want = read_f32(&p(&format!("{src}.deq")));
            let got = dequantize(ty, &raw);
            assert_eq!(got.len(), want.len(), "{name} {src}");
            if let Some(i) = (0..got.len()).find(|&i| !same_bits(got[i], want[i])) {
                failures.push(format!(
                    "{name} {src} blocks: value {i} dequantizes to {} here, {} in llama.cpp",
                    got[i], want[i]
                ));
            }
        }
        // Dot products of the same blocks with the same activation.
        let mut act = ActBuf::new();
        act.prepare(ty, &a).unwrap();
        let (mut exact, mut total, mut worst) = (0, 0, 0f64);
        for src in ["ours", "llama"] {
            let raw = std::fs::read(p(src)).unwrap();
            let want = read_f32(&p(&format!("{src}.dot")));
            let mut got = vec![0f32; ROWS];
            kernels::matvec(&pool, ty, &raw, ROWS, N, &act, &mut got).unwrap();
            let w = dequantize(ty, &raw);
            for (r, (g, l)) in got.iter().zip(&want).enumerate() {
                total += 1;
                exact += same_bits(*g, *l) as usize;
                // Float rounding of differently ordered sums of the same exact terms, and a
                // different rounding of the activation for the float formats' f16/bf16 forms:
                // far below what any misread bit would do.
                let scale: f64 = w[r * N..(r + 1) * N]
                    .iter()
                    .zip(&a)
                    .map(|(w, a)| (*w as f64 * *a as f64).abs())
                    .sum();
                let rel = (*g as f64 - *l as f64).abs() / scale.max(f64::MIN_POSITIVE);
                worst = worst.max(rel);
                if rel > 1e-5 {
                    failures.push(format!(
                        "{name} {src} row {r}: dot {g} here, {l} in llama.cpp (relative {rel:.2e})"
                    ));
                }
            }
        }
        eprintln!("{name}: dot bits equal to llama.cpp's on {exact}/{total} rows, worst relative difference {worst:.2e}");
        if avx2 && EXACT.contains(&ty) && exact != total {
            failures.push(format!(
                "{name}: our summation order is documented as llama.cpp's x86 one, yet only {exact}/{total} rows have its bits"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
