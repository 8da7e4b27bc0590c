//! The kernel benchmark behind `bmoe-cli bench`: how close each format's matrix · vector
//! product comes to the machine's memory bandwidth.
//!
//! Decode streams every active weight byte once per token, so the number that matters is
//! weight bytes per second against what the memory can deliver. Both are measured side by side
//! in one run, on buffers larger than the last-level cache: a STREAM-style read (sum) and copy,
//! then [`super::matvec`] per format at every SIMD level this CPU has, reported as GB/s and as a
//! ratio to the measured read bandwidth. Not a test: numbers depend on the machine and load.

use super::{matvec_at, quantize_row, ActBuf, SimdLevel, ThreadPool};
use crate::gguf::GgmlType;
use std::fmt;
use std::time::Instant;

/// Timed passes per measurement; the best is kept (as STREAM does), after one warm-up pass.
const PASSES: usize = 5;
/// Columns of the benchmark matrices (a typical hidden size).
const N_COLS: usize = 4096;
/// Size of the cache-resident matrix, and how often one pass repeats it.
const CACHED_BYTES: usize = 768 * 1024;
const CACHED_REPEATS: usize = 32;

/// One format at one SIMD level.
#[derive(Clone, Debug)]
pub struct FormatResult {
    pub ty: GgmlType,
    pub level: SimdLevel,
    pub n_rows: usize,
    pub n_cols: usize,
    pub weight_bytes: usize,
    /// Best pass.
    pub best_s: f64,
    /// Weight bytes / best pass, in GB/s (10^9 bytes).
    pub gbps: f64,
    /// `gbps` over the measured memory read bandwidth.
    pub ratio_to_read: f64,
    /// Weight bytes per second on a matrix that fits in L2 (the kernel's compute ceiling):
    /// when `gbps` is well below it, the product is bound by memory, not arithmetic.
    pub cached_gbps: f64,
}

/// Everything one benchmark run measured.
#[derive(Clone, Debug)]
pub struct BenchReport {
    pub threads: usize,
    pub size_mib: usize,
    /// The level [`super::matvec`] dispatches to on this CPU.
    pub level: SimdLevel,
    /// STREAM-style read (sum of all words), GB/s.
    pub read_gbps: f64,
    /// STREAM-style copy, bytes read plus bytes written per second, GB/s.
    pub copy_gbps: f64,
    /// Mean time of one decode-sized product (a 768 x 2048 Q4_K expert projection, 864 KiB,
    /// cache-resident), so per-call overhead shows: compare across thread counts.
    pub expert_matvec_us: f64,
    /// The same matrix times 16 activations with [`super::matmul`] (prefill), per token.
    pub expert_matmul_us_per_token: f64,
    pub formats: Vec<FormatResult>,
}

/// Runs the benchmark with `threads` compute threads on matrices of about `size_mib` MiB each
/// (use ≥ 256 so they do not fit in the last-level cache; at least 1). Takes a few seconds per
/// 256 MiB.
pub fn run_bench(threads: usize, size_mib: usize) -> BenchReport {
    let pool = ThreadPool::new(threads.max(1));
    let size_bytes = size_mib.max(1) * 1024 * 1024;
    // Written through before timing: untouched pages would all read the kernel's zero page.
    let mut buf: Vec<u8> = (0..size_bytes).map(|i| (i * 131 % 251) as u8).collect();
    let (read_gbps, copy_gbps) = memory_bandwidth(&pool, &mut buf);
    let (expert_matvec_us, expert_matmul_us_per_token) = expert_products_us(&pool);

    let mut formats = Vec::new();
    // Every weight format the kernels have.
    for &ty in super::weight_types() {
        let Some(row_bytes) = ty.row_bytes(N_COLS as u64).map(|b| b as usize) else {
            continue;
        };
        let n_rows = (size_bytes / row_bytes).max(1);
        let weight_bytes = n_rows * row_bytes;
        if buf.len() < weight_bytes {
            buf.resize(weight_bytes, 0);
        }
        let w = &mut buf[..weight_bytes];
        fill_weights(ty, w, row_bytes);
        let mut act = ActBuf::new();
        let x: Vec<f32> = (0..N_COLS)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        if act.prepare(ty, &x).is_err() {
            continue;
        }
        let mut out = vec![0f32; n_rows];
        for level in bench_levels() {
            let best_s = best_of(|| {
                // Shapes were built to fit; an error here would be a bug, and shows as NaN.
                if matvec_at(&pool, level, ty, w, n_rows, N_COLS, &act, &mut out).is_err() {
                    out[0] = f32::NAN;
                }
                std::hint::black_box(&out);
            });
            let gbps = weight_bytes as f64 / best_s / 1e9;
            // The first rows again, few enough to stay in L2, many times per pass.
            let cached_rows = (CACHED_BYTES / row_bytes).clamp(1, n_rows);
            let cached_s = best_of(|| {
                for _ in 0..CACHED_REPEATS {
                    let w = &w[..cached_rows * row_bytes];
                    let out = &mut out[..cached_rows];
                    if matvec_at(&pool, level, ty, w, cached_rows, N_COLS, &act, out).is_err() {
                        out[0] = f32::NAN;
                    }
                    std::hint::black_box(&out);
                }
            });
            let cached_gbps = (cached_rows * row_bytes * CACHED_REPEATS) as f64 / cached_s / 1e9;
            formats.push(FormatResult {
                cached_gbps,
                ty,
                level,
                n_rows,
                n_cols: N_COLS,
                weight_bytes,
                best_s,
                gbps,
                ratio_to_read: gbps / read_gbps,
            });
        }
    }
    BenchReport {
        threads: pool.n_threads(),
        size_mib,
        level: super::simd_level(),
        read_gbps,
        copy_gbps,
        expert_matvec_us,
        expert_matmul_us_per_token,
        formats,
    }
}

/// (one matvec, one 16-token matmul per token), in microseconds, on an expert-sized Q4_K
/// matrix that stays in cache.
fn expert_products_us(pool: &ThreadPool) -> (f64, f64) {
    const RUNS: usize = 1000;
    const TOKENS: usize = 16;
    let (ty, n_rows, n_cols) = (GgmlType::Q4_K, 768, 2048);
    let row_bytes = ty.row_bytes(n_cols as u64).map_or(0, |b| b as usize);
    let mut w = vec![0u8; n_rows * row_bytes];
    fill_weights_cols(ty, &mut w, row_bytes, n_cols);
    let mut acts = vec![ActBuf::new(); TOKENS];
    for (t, act) in acts.iter_mut().enumerate() {
        let x: Vec<f32> = (0..n_cols)
            .map(|i| ((i * 37 + t * 11) % 101) as f32 / 50.0 - 1.0)
            .collect();
        if act.prepare(ty, &x).is_err() {
            return (f64::NAN, f64::NAN);
        }
    }
    let mut out = vec![0f32; n_rows * TOKENS];
    let mut time = |f: &mut dyn FnMut(&mut [f32]) -> bool, runs: usize| {
        f(&mut out);
        let t = Instant::now();
        for _ in 0..runs {
            if !f(&mut out) {
                return f64::NAN;
            }
            std::hint::black_box(&out);
        }
        t.elapsed().as_secs_f64() * 1e6 / runs as f64
    };
    let matvec_us = time(
        &mut |out| {
            super::matvec(pool, ty, &w, n_rows, n_cols, &acts[0], &mut out[..n_rows]).is_ok()
        },
        RUNS,
    );
    let matmul_us = time(
        &mut |out| super::matmul(pool, ty, &w, n_rows, n_cols, &acts, out).is_ok(),
        RUNS / TOKENS,
    );
    (matvec_us, matmul_us / TOKENS as f64)
}

/// The SIMD levels worth timing: every vector level (side by side, to show whether a wider
/// one pays), or scalar when there is none.
fn bench_levels() -> Vec<SimdLevel> {
    let all = SimdLevel::available();
    if all.len() > 1 {
        all.into_iter()
            .filter(|l| *l != SimdLevel::Scalar)
            .collect()
    } else {
        all
    }
}

/// Fills `w` with realistic rows of `ty`: 64 quantized random rows, repeated.
fn fill_weights(ty: GgmlType, w: &mut [u8], row_bytes: usize) {
    fill_weights_cols(ty, w, row_bytes, N_COLS)
}

fn fill_weights_cols(ty: GgmlType, w: &mut [u8], row_bytes: usize, n_cols: usize) {
    const DISTINCT: usize = 64;
    let mut rows = vec![0u8; DISTINCT * row_bytes];
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut src = vec![0f32; n_cols];
    for r in 0..DISTINCT {
        for v in src.iter_mut() {
            // xorshift: deterministic, cheap, roughly uniform in [-0.05, 0.05).
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            *v = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
        }
        // Cannot fail: the column counts used are whole numbers of blocks of every format.
        let _ = quantize_row(ty, &src, &mut rows[r * row_bytes..(r + 1) * row_bytes]);
    }
    for (i, row) in w.chunks_exact_mut(row_bytes).enumerate() {
        let k = i % DISTINCT;
        row.copy_from_slice(&rows[k * row_bytes..(k + 1) * row_bytes]);
    }
}

fn best_of(mut f: impl FnMut()) -> f64 {
    f();
    (0..PASSES)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Only the memory bandwidth of [`run_bench`]: (read GB/s, copy GB/s) with `threads` threads
/// over a buffer of about `size_mib` MiB (at least 1).
pub fn memory_only(threads: usize, size_mib: usize) -> (f64, f64) {
    let pool = ThreadPool::new(threads.max(1));
    let size_bytes = size_mib.max(1) * 1024 * 1024;
    let mut buf: Vec<u8> = (0..size_bytes).map(|i| (i * 131 % 251) as u8).collect();
    memory_bandwidth(&pool, &mut buf)
}

/// (read GB/s, copy GB/s) over `buf`, split across the pool like the products are.
fn memory_bandwidth(pool: &ThreadPool, buf: &mut [u8]) -> (f64, f64) {
    let chunk = 1 << 20;
    let n_tasks = buf.len().div_ceil(chunk);
    let read_s = {
        let buf = &*buf;
        best_of(|| {
            let total = std::sync::atomic::AtomicU64::new(0);
            pool.run(n_tasks, &|t| {
                let part = &buf[t * chunk..((t + 1) * chunk).min(buf.len())];
                let s = sum_words(part);
                total.fetch_add(s, std::sync::atomic::Ordering::Relaxed);
            });
            std::hint::black_box(total.into_inner());
        })
    };
    let read_gbps = buf.len() as f64 / read_s / 1e9;

    // Copy the first half onto the second.
    let half = buf.len() / 2 / chunk * chunk;
    let (src, dst) = buf.split_at_mut(half);
    let dst = &mut dst[..half];
    let n_tasks = half / chunk;
    let dst_ptr = super::OutPtr(dst.as_mut_ptr().cast::<f32>());
    let copy_s = best_of(|| {
        pool.run(n_tasks, &|t| {
            let from = &src[t * chunk..(t + 1) * chunk];
            // SAFETY: task t owns bytes t*chunk..(t+1)*chunk of `dst`, which is `half` long;
            // the pointer outlives the run.
            let to = unsafe {
                std::slice::from_raw_parts_mut(dst_ptr.get().cast::<u8>().add(t * chunk), chunk)
            };
            to.copy_from_slice(from);
        });
    });
    let copy_gbps = 2.0 * half as f64 / copy_s / 1e9;
    (read_gbps, copy_gbps)
}

/// Wrapping sum of the buffer as u64 words; the value only defeats elision. Vector loads
/// where the CPU has them, so the loop is bound by memory, not by the adds.
fn sum_words(b: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if super::simd_level() >= SimdLevel::Avx2 {
        // SAFETY: AVX2 is present.
        return unsafe { sum_words_avx2(b) };
    }
    let mut lanes = [0u64; 8];
    let mut words = b.chunks_exact(64);
    for w in &mut words {
        for (k, lane) in lanes.iter_mut().enumerate() {
            let mut x = [0u8; 8];
            x.copy_from_slice(&w[8 * k..8 * k + 8]);
            *lane = lane.wrapping_add(u64::from_le_bytes(x));
        }
    }
    let tail: u64 = words.remainder().iter().map(|v| *v as u64).sum();
    lanes.iter().fold(tail, |a, v| a.wrapping_add(*v))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(b: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut blocks = b.chunks_exact(128);
    for blk in &mut blocks {
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: 32 bytes at 32k inside the 128-byte block.
            let v = unsafe { _mm256_loadu_si256(blk.as_ptr().add(32 * k).cast()) };
            *a = _mm256_add_epi64(*a, v);
        }
    }
    let mut lanes = [0u64; 4];
    let total = _mm256_add_epi64(
        _mm256_add_epi64(acc[0], acc[1]),
        _mm256_add_epi64(acc[2], acc[3]),
    );
    // SAFETY: 4 u64.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().cast(), total) };
    let tail: u64 = blocks.remainder().iter().map(|v| *v as u64).sum();
    lanes.iter().fold(tail, |a, v| a.wrapping_add(*v))
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kernel bench: {} thread(s), {} MiB per matrix, dispatch level {}",
            self.threads,
            self.size_mib,
            self.level.name()
        )?;
        writeln!(
            f,
            "memory: read {:.1} GB/s, copy {:.1} GB/s (read + written)",
            self.read_gbps, self.copy_gbps
        )?;
        writeln!(
            f,
            "expert-sized product (Q4_K 768x2048, in cache): matvec {:.1} us, \
             16-token matmul {:.1} us per token",
            self.expert_matvec_us, self.expert_matmul_us_per_token
        )?;
        writeln!(
            f,
            "{:<6} {:<7} {:>14} {:>9} {:>8} {:>8} {:>12}",
            "format", "level", "rows x cols", "MiB", "GB/s", "x read", "in-L2 GB/s"
        )?;
        for r in &self.formats {
            writeln!(
                f,
                "{:<6} {:<7} {:>14} {:>9.1} {:>8.2} {:>8.2} {:>12.2}",
                r.ty.name(),
                r.level.name(),
                format!("{}x{}", r.n_rows, r.n_cols),
                r.weight_bytes as f64 / (1024.0 * 1024.0),
                r.gbps,
                r.ratio_to_read,
                r.cached_gbps
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_reports_every_format_and_level() {
        let r = run_bench(2, 2);
        assert_eq!(
            r.formats.len(),
            super::super::weight_types().len() * bench_levels().len()
        );
        assert!(
            r.read_gbps > 0.0
                && r.copy_gbps > 0.0
                && r.expert_matvec_us > 0.0
                && r.expert_matmul_us_per_token > 0.0
        );
        for f in &r.formats {
            assert!(f.gbps.is_finite() && f.gbps > 0.0, "{f:?}");
            assert!(f.cached_gbps.is_finite() && f.cached_gbps > 0.0, "{f:?}");
        }
        let text = r.to_string();
        assert!(
            text.contains("Q4_K") && text.contains("memory: read"),
            "{text}"
        );
    }

    /// A quick look at the in-L2 column while tuning a kernel.
    #[test]
    #[ignore]
    fn bench_quick() {
        println!("{}", run_bench(1, 8));
    }

    /// The real measurement: `cargo test --release -p bmoe-engine --lib kernels::bench --
    /// --ignored --nocapture`.
    #[test]
    #[ignore]
    fn bench_1_and_2_threads() {
        for threads in [1, 2] {
            println!("{}", run_bench(threads, 256));
        }
    }
}
