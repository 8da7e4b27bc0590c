//! One kernel call between two marker functions, for `scripts/arm-mca.py`, which prices our
//! kernels per ARM core model: it runs this binary under `qemu-aarch64-static -singlestep -d
//! exec,nochain`, keeps the instructions executed after [`bmoe_trace_begin`] returns and before
//! [`bmoe_trace_end`] is entered, and feeds them to llvm-mca as straight-line code for two row
//! lengths; their difference per 256 weights is the kernel's cost per 256 weights, with the
//! call's fixed costs (checks, prologue, reduction) cancelled.
//!
//! `kernel_trace FORMAT decode|prefill N256 ROWS TOKENS`
//! - FORMAT: a ggml type name (`Q4_K`, `F16`, ...); N256: the row length in 256-weight units.
//! - decode: one [`dot_rows`] call over ROWS rows with one activation (what `matvec` runs per
//!   task); prefill: one [`matmul`] of ROWS rows by TOKENS activations on a one-thread pool, so
//!   the whole product runs on this thread through the grouped and wide kernels as prefill does.
//!
//! Every call runs once untraced first: the level detection and the per-thread packings of the
//! activations (which a real product builds once and reuses over all its rows) are then warm,
//! so the traced call is the steady state. `BMOE_SIMD` caps the level as everywhere else.
//!
//! The weights are one quantized 256-value chunk repeated (cheap to build, so the trace is not
//! flooded by the quantizer, and every block takes the same data-dependent path); the tokens are
//! copies of one prepared activation.

use bmoe_engine::gguf::GgmlType;
use bmoe_engine::kernels::{dot_rows, matmul, quantize_row, ActBuf, ThreadPool};
use std::hint::black_box;
use std::process::exit;

/// Entered just before the traced call (the trace starts when it returns).
#[no_mangle]
#[inline(never)]
pub extern "C" fn bmoe_trace_begin() {
    black_box(1u32);
}

/// Entered just after the traced call (the trace stops here). Not the same body as
/// [`bmoe_trace_begin`], so the two cannot be folded into one address.
#[no_mangle]
#[inline(never)]
pub extern "C" fn bmoe_trace_end() {
    black_box(2u64);
}

/// Deterministic values in about [-1, 1) (a 64-bit LCG's high bits), so every run and every
/// level sees the same data.
fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Sum of two uniforms: a bell-ish shape, as weights and activations have.
            let a = (s >> 40) as f32 / (1u64 << 24) as f32;
            let b = ((s >> 16) & 0xff_ffff) as f32 / (1u64 << 24) as f32;
            a + b - 1.0
        })
        .collect()
}

fn fail(msg: &str) -> ! {
    eprintln!("kernel_trace: {msg}");
    exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6 {
        fail("usage: kernel_trace FORMAT decode|prefill N256 ROWS TOKENS");
    }
    let ty = GgmlType::from_name(&args[1])
        .unwrap_or_else(|| fail(&format!("unknown format {:?}", args[1])));
    let prefill = match args[2].as_str() {
        "decode" => false,
        "prefill" => true,
        m => fail(&format!("mode {m:?} is neither decode nor prefill")),
    };
    let number = |i: usize| -> usize {
        args[i]
            .parse()
            .ok()
            .filter(|&v| v > 0)
            .unwrap_or_else(|| fail(&format!("{:?} is not a positive count", args[i])))
    };
    let (n256, n_rows, n_tokens) = (number(3), number(4), number(5));
    let n_cols = n256 * 256;

    let chunk_bytes =
        ty.row_bytes(256)
            .unwrap_or_else(|| fail(&format!("{ty} has no 256-value rows"))) as usize;
    let mut chunk = vec![0u8; chunk_bytes];
    quantize_row(ty, &values(1, 256), &mut chunk)
        .unwrap_or_else(|e| fail(&format!("quantize: {e}")));
    let w: Vec<u8> = chunk
        .iter()
        .copied()
        .cycle()
        .take(chunk_bytes * n256 * n_rows)
        .collect();

    let mut act = ActBuf::new();
    act.prepare(ty, &values(2, n_cols))
        .unwrap_or_else(|e| fail(&format!("prepare: {e}")));
    let pool = ThreadPool::new(1);
    let acts = vec![act; if prefill { n_tokens } else { 1 }];
    let mut out = vec![0f32; acts.len() * n_rows];

    let call = |out: &mut [f32]| {
        let r = if prefill {
            matmul(&pool, ty, &w, n_rows, n_cols, &acts, out)
        } else {
            dot_rows(ty, &w, n_cols, 0..n_rows, &acts[0], out)
        };
        r.unwrap_or_else(|e| fail(&format!("kernel: {e}")));
    };
    call(&mut out);
    bmoe_trace_begin();
    call(black_box(&mut out));
    bmoe_trace_end();
    let sum: f64 = black_box(&out).iter().map(|&v| v as f64).sum();
    println!("{ty} {} rows={n_rows} cols={n_cols} sum={sum:e}", args[2]);
}
