//! The building blocks every architecture file composes its layers from: matrix products over
//! GGUF weights on the compute pool, RMS norms, rotary embeddings (NeoX and normal pairs,
//! frequency factors, YaRN), attention (GQA, a sliding window, attention sinks, score
//! soft-capping), the FFN activations (SiLU-GLU, GELU-GLU as ggml computes it, the clamped
//! SwiGLU of gpt-oss) and logit soft-capping.
//!
//! Formulas follow ggml's CPU implementation (read for facts, written here): the same order of
//! operations where it matters for the bits (norms square in f32 and sum in f64; a softmax sums
//! its exponentials in f64 and multiplies by one reciprocal; GELU goes through f16 as ggml's
//! table does), so our logits stay close to llama.cpp's position by position.
//!
//! Every transcendental function here gives the same bits on every target, so an aarch64 (musl
//! or glibc) build writes the x86 build's logits: `exp`, `ln`, `powf` and `sqrt` of f32 are the
//! platform's (glibc's and musl's agree bit for bit: the same correctly-rounding-in-practice
//! code; `sqrt` is exact), while `tanh`, `sin` and `cos`, whose platform versions differ between
//! x86 glibc, aarch64 glibc and musl, come from the pure-Rust `libm` crate (musl's code, the same
//! operations on every target). `transcendentals_give_the_same_bits_on_every_target` pins them.
//!
//! SIMD: the norms, rope and the GLU products are plain loops that the compiler vectorises
//! without reordering (on aarch64, NEON is the baseline: the RMS norm's squares and widenings
//! four at a time, its f64 sum one add after another in the scalar order, which no vector form
//! keeps; rope's pairs by `ld2`/`st2`). SiLU and gpt-oss's SwiGLU call the platform's `expf`
//! per value, which no vector code reproduces bit for bit, so those calls stay scalar. GELU's
//! f16 rounding and ±10 short-cuts have a NEON path ([`gelu_glu`]), the table read per lane.

use super::state::KvSource;
use super::weights::Mat;
use super::ArchError;
use crate::gguf::GgmlType;
use crate::kernels::{self, ActBuf, ThreadPool};

/// A kernel failure as an architecture error.
pub fn kerr(e: kernels::KernelError) -> ArchError {
    ArchError::Tensor {
        file: String::new(),
        tensor: String::new(),
        what: format!("kernel: {e}"),
    }
}

/// The compute pool the forward pass runs its products on.
pub struct Compute {
    pub pool: ThreadPool,
}

impl Compute {
    pub fn new(threads: usize) -> Compute {
        Compute {
            pool: ThreadPool::new(threads.max(1)),
        }
    }

    /// `out` (token-major, `n × m.rows`) = `m` · each of the `n` rows of `input` (`n × m.cols`).
    pub fn mat_rows(
        &self,
        m: &Mat,
        input: &[f32],
        n: usize,
        acts: &mut Vec<ActBuf>,
        out: &mut [f32],
    ) -> Result<(), ArchError> {
        self.bytes_rows(m.ty, m.bytes(), m.rows, m.cols, input, n, acts, out)
    }

    /// As [`Compute::mat_rows`] for a matrix given as bytes of type `ty` (an expert's
    /// projection, wherever it lives).
    #[allow(clippy::too_many_arguments)]
    pub fn bytes_rows(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        input: &[f32],
        n: usize,
        acts: &mut Vec<ActBuf>,
        out: &mut [f32],
    ) -> Result<(), ArchError> {
        prepare_acts(&self.pool, ty, input, n, cols, acts)?;
        mul_prepared(&self.pool, ty, w, rows, cols, &acts[..n], out)
    }
}

/// `out_i` (token-major, `n × mats[i].rows`) = `mats[i]` · each of the `n` rows of `input`
/// for matrices that read the same input (attention's q, k, v): quantised once and run in one
/// round of the pool when their activation formats agree, one by one otherwise. The bits are
/// those of [`Compute::mat_rows`] for each.
impl Compute {
    pub fn mats_rows(
        &self,
        mats: &mut [(&Mat, &mut [f32])],
        input: &[f32],
        n: usize,
        acts: &mut Vec<ActBuf>,
    ) -> Result<(), ArchError> {
        let Some((first, _)) = mats.first() else {
            return Ok(());
        };
        let (ty, cols) = (first.ty, first.cols);
        let fmt = kernels::ActFormat::for_weights(ty);
        let shared = fmt.is_some()
            && mats
                .iter()
                .all(|(m, _)| m.cols == cols && kernels::ActFormat::for_weights(m.ty) == fmt);
        if !shared {
            for (m, out) in mats.iter_mut() {
                self.mat_rows(m, input, n, acts, out)?;
            }
            return Ok(());
        }
        prepare_acts(&self.pool, ty, input, n, cols, acts)?;
        let acts = &acts[..n];
        let mut products: Vec<kernels::Product<'_, ActBuf>> = mats
            .iter_mut()
            .map(|(m, out)| kernels::Product {
                ty: m.ty,
                w: m.bytes(),
                n_rows: m.rows,
                n_cols: m.cols,
                acts,
                out: &mut out[..n * m.rows],
            })
            .collect();
        kernels::matmul_round(&self.pool, &mut products).map_err(kerr)
    }
}

/// Quantize `n` input rows of `cols` values for dot products with weights of type `ty`, once
/// for the batch, the rows split across the pool.
pub fn prepare_acts(
    pool: &ThreadPool,
    ty: GgmlType,
    input: &[f32],
    n: usize,
    cols: usize,
    acts: &mut Vec<ActBuf>,
) -> Result<(), ArchError> {
    if acts.len() < n {
        acts.resize_with(n, ActBuf::new);
    }
    kernels::prepare_rows(pool, ty, &input[..n * cols], cols, &mut acts[..n]).map_err(kerr)
}

/// `out` (token-major, `acts.len() × rows`) = W · act for each prepared activation: one
/// matvec for a single token, one batched matmul (same bits per row) otherwise. The
/// activations are taken by reference, so rows prepared once serve several matrices.
pub fn mul_prepared<A: std::borrow::Borrow<ActBuf> + Sync>(
    pool: &ThreadPool,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    acts: &[A],
    out: &mut [f32],
) -> Result<(), ArchError> {
    let n = acts.len();
    if n == 1 {
        kernels::matvec(pool, ty, w, rows, cols, acts[0].borrow(), &mut out[..rows]).map_err(kerr)
    } else {
        kernels::matmul(pool, ty, w, rows, cols, acts, &mut out[..n * rows]).map_err(kerr)
    }
}

// ---------------------------------------------------------------------------------------------
// Norms

/// RMS norm of `x` into `out`, times `w` when given (ggml `rms_norm`, then `mul`): square in
/// f32, sum widened to f64, as llama.cpp does, so the bits of the norm follow its order.
pub fn rms_norm(x: &[f32], w: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let ss: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    match w {
        Some(w) => {
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = v * scale * g;
            }
        }
        None => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = v * scale;
            }
        }
    }
}

/// RMS norm of the `rows` of `x` (each `d` wide) into consecutive rows of `out`.
pub fn rms_norm_rows(
    x: &[f32],
    d: usize,
    rows: &[u32],
    w: Option<&[f32]>,
    eps: f32,
    out: &mut Vec<f32>,
) {
    out.resize(rows.len() * d, 0.0);
    for (i, &r) in rows.iter().enumerate() {
        let r = r as usize;
        rms_norm(&x[r * d..(r + 1) * d], w, eps, &mut out[i * d..(i + 1) * d]);
    }
}

/// RMS norm of every `d`-wide row of `x` into `out` (the same number of rows).
pub fn rms_norm_all(x: &[f32], d: usize, w: Option<&[f32]>, eps: f32, out: &mut Vec<f32>) {
    out.resize(x.len(), 0.0);
    for (src, dst) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        rms_norm(src, w, eps, dst);
    }
}

/// RMS norm of every `d`-wide row of `v`, in place (per-head q/k norms), `tmp` scratch.
pub fn rms_norm_heads(v: &mut [f32], d: usize, w: Option<&[f32]>, eps: f32, tmp: &mut Vec<f32>) {
    tmp.resize(d, 0.0);
    for head in v.chunks_exact_mut(d) {
        rms_norm(head, w, eps, tmp);
        head.copy_from_slice(tmp);
    }
}

/// `rows` consecutive rows of `v` (each `bias.len()` wide) plus `bias`.
pub fn add_bias(v: &mut [f32], bias: &[f32]) {
    for row in v.chunks_exact_mut(bias.len()) {
        for (x, &b) in row.iter_mut().zip(bias) {
            *x += b;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rotary embedding

/// Which dimensions a rotation pairs: NeoX pairs `i` with `i + n/2` (qwen, gemma, gpt-oss),
/// the original pairs `2i` with `2i + 1`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RopeKind {
    Neox,
    Normal,
}

/// A rotary embedding as ggml's `rope_ext` computes it: `n_dims` rotated dimensions (the rest
/// pass through), base `base`, optional per-pair frequency divisors (`rope_freqs`), and YaRN
/// (`freq_scale < 1` with `ext_factor`, ramp between `corr_dims`, magnitude `attn_factor`).
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub kind: RopeKind,
    pub n_dims: usize,
    pub base: f32,
    pub freq_scale: f32,
    pub ext_factor: f32,
    pub attn_factor: f32,
    pub corr_dims: [f32; 2],
    pub freq_factors: Option<Vec<f32>>,
}

/// YaRN's parameters as a GGUF file states them (`rope.scaling.*`).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.factor`: context extension factor (`freq_scale = 1/factor`).
    pub factor: f32,
    /// `rope.scaling.original_context_length`.
    pub n_ctx_orig: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// `rope.scaling.attn_factor` (llama.cpp's `rope_attn_factor`, 1 when absent).
    pub attn_factor: f32,
}

fn yarn_corr_dim(n_dims: usize, n_ctx_orig: usize, n_rot: f32, base: f32) -> f32 {
    n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
        / (2.0 * base.ln())
}

impl Rope {
    /// No scaling.
    pub fn plain(kind: RopeKind, n_dims: usize, base: f32) -> Rope {
        Rope {
            kind,
            n_dims,
            base,
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: 1.0,
            corr_dims: [0.0, 0.0],
            freq_factors: None,
        }
    }

    /// YaRN scaling as llama.cpp sets it up (`ext_factor` 1, the magnitude correction
    /// `0.1·ln(factor) + 1` folded into `attn_factor` and cancelled by the kernel's own).
    pub fn yarn(kind: RopeKind, n_dims: usize, base: f32, y: Yarn) -> Rope {
        let mut r = Rope::plain(kind, n_dims, base);
        if y.factor <= 1.0 {
            r.attn_factor = y.attn_factor;
            return r;
        }
        r.freq_scale = 1.0 / y.factor;
        r.ext_factor = 1.0;
        let mscale = 0.1 * y.factor.ln() + 1.0;
        r.attn_factor = mscale * (1.0 / (1.0 + 0.1 * y.factor.ln())) * y.attn_factor;
        let start = yarn_corr_dim(n_dims, y.n_ctx_orig, y.beta_fast, base).floor();
        let end = yarn_corr_dim(n_dims, y.n_ctx_orig, y.beta_slow, base).ceil();
        r.corr_dims = [start.max(0.0), end.min(n_dims as f32 - 1.0)];
        r
    }

    /// With per-pair frequency divisors (`rope_freqs.weight`, `n_dims/2` values).
    pub fn with_freq_factors(mut self, f: Option<Vec<f32>>) -> Rope {
        self.freq_factors = f;
        self
    }

    /// The (cos, sin) pairs for position `pos` into `cache` (`n_dims` values), as ggml's
    /// `rope_cache_init`: θ starts at `pos` and is multiplied by `base^(-2/n_dims)` per pair.
    pub fn cache(&self, pos: u32, cache: &mut Vec<f32>) {
        cache.resize(self.n_dims, 0.0);
        let theta_scale = self.base.powf(-2.0 / self.n_dims as f32);
        let mut theta = pos as f32;
        for i0 in (0..self.n_dims).step_by(2) {
            let ff = self
                .freq_factors
                .as_ref()
                .and_then(|f| f.get(i0 / 2).copied())
                .unwrap_or(1.0);
            let extrap = theta / ff;
            let interp = self.freq_scale * extrap;
            let mut th = interp;
            let mut mscale = self.attn_factor;
            if self.ext_factor != 0.0 {
                let y = (i0 as f32 / 2.0 - self.corr_dims[0])
                    / (self.corr_dims[1] - self.corr_dims[0]).max(0.001);
                let ramp = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
                th = interp * (1.0 - ramp) + extrap * ramp;
                mscale *= 1.0 + 0.1 * (1.0 / self.freq_scale).ln();
            }
            // libm, not the platform's sinf/cosf (musl's differ from glibc's).
            let (sin, cos) = libm::sincosf(th);
            cache[i0] = cos * mscale;
            cache[i0 + 1] = sin * mscale;
            theta *= theta_scale;
        }
    }

    /// Rotate one head `v` (its first `n_dims` values) by a position's `cache`.
    pub fn apply(&self, cache: &[f32], v: &mut [f32]) {
        let n = self.n_dims;
        match self.kind {
            RopeKind::Neox => {
                let half = n / 2;
                for i in 0..half {
                    let (c, s) = (cache[2 * i], cache[2 * i + 1]);
                    let (a, b) = (v[i], v[i + half]);
                    v[i] = a * c - b * s;
                    v[i + half] = a * s + b * c;
                }
            }
            RopeKind::Normal => {
                for i in 0..n / 2 {
                    let (c, s) = (cache[2 * i], cache[2 * i + 1]);
                    let (a, b) = (v[2 * i], v[2 * i + 1]);
                    v[2 * i] = a * c - b * s;
                    v[2 * i + 1] = a * s + b * c;
                }
            }
        }
    }

    /// Rotate every `head_dim`-wide head of each row of `rows` (row `r` at `positions[r]`).
    pub fn apply_rows(
        &self,
        rows: &mut [f32],
        row_width: usize,
        head_dim: usize,
        positions: &[u32],
        cache: &mut Vec<f32>,
    ) {
        for (row, &pos) in rows.chunks_exact_mut(row_width).zip(positions) {
            self.cache(pos, cache);
            for head in row.chunks_exact_mut(head_dim) {
                self.apply(cache, head);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attention

pub use crate::kernels::attn::AttnShape;

impl kernels::attn::KvRows for KvSource<'_> {
    #[inline(always)]
    fn key(&self, pos: usize) -> &[f32] {
        KvSource::key(self, pos)
    }
    #[inline(always)]
    fn value(&self, pos: usize) -> &[f32] {
        KvSource::value(self, pos)
    }
}

/// Causal multi-head attention of `q` (`positions.len()` rows × `n_head·head_dim`) over the
/// keys and values of `kv`, GQA (query head `h` reads KV head `h / (n_head / n_head_kv)`),
/// into `out` (same shape as `q`). `sinks` (one logit per query head) joins each softmax
/// without a value (gpt-oss). Tiled over (KV head, its query heads, rows) on the pool by
/// [`kernels::attn::attend`]; a row's bits do not depend on the batch, the threads or the SIMD
/// level. `scores` is scratch.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    pool: &ThreadPool,
    shape: &AttnShape,
    q: &[f32],
    positions: &[u32],
    kv: &KvSource<'_>,
    sinks: Option<&[f32]>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    kernels::attn::attend(
        pool,
        kernels::simd_level(),
        shape,
        q,
        positions,
        kv,
        sinks,
        scores,
        out,
    );
}

/// `a · b` in 8 lanes (element `i` into lane `i % 8`, then the lanes summed pairwise in a fixed
/// tree): the compiler vectorises it where a sequential sum must wait for each add, and the
/// order — so the bits — is the same on every machine and for any batch (a query row's
/// scores do not depend on what else is in the batch).
#[inline]
pub fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; 8];
    let (ac, bc) = (a[..n].chunks_exact(8), b[..n].chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ar.iter().zip(br).enumerate() {
        acc[l] += x * y;
    }
    let q = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (q[0] + q[2]) + (q[1] + q[3])
}

// ---------------------------------------------------------------------------------------------
// Activations

/// SiLU: `x·σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The logistic function, as ggml's `sigmoid`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// GELU (tanh approximation) as ggml's CPU computes it: through an f16 table, so the input is
/// rounded to f16 and so is the result (`|x| ≥ 10` short-cuts to 0 or `x`). The table holds
/// [`gelu_of_f16`] for every f16 bit pattern, as f32 (256 KiB, filled on first use): a lookup
/// instead of a `tanh` per value — on gemma4, whose dense MLP and experts are all GELU-gated,
/// the `tanh` was a fifth of the prefill's time.
#[inline]
pub fn gelu(x: f32) -> f32 {
    if x <= -10.0 {
        return 0.0;
    }
    if x >= 10.0 {
        return x;
    }
    gelu_table()[half::f16::from_f32(x).to_bits() as usize]
}

/// [`gelu`]'s table, by f16 bit pattern.
fn gelu_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Box<[f32]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| gelu_of_f16(half::f16::from_bits(bits)))
            .collect()
    })
}

/// `gate[i] = gelu(gate[i])·up[i]` at `level`: the scalar loop, or on aarch64 four values a
/// step with the f16 rounding by `fcvtn` (round to nearest even, as `half`'s conversion) and
/// the ±10 short-cuts by selects; the table is read one lane at a time (NEON has no gather).
/// The same bits at every level.
fn gelu_glu(level: kernels::SimdLevel, gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    #[cfg(target_arch = "aarch64")]
    let done = if level >= kernels::SimdLevel::Neon {
        gelu_glu_neon(&mut gate[..n], &up[..n])
    } else {
        0
    };
    #[cfg(not(target_arch = "aarch64"))]
    let done = {
        let _ = level;
        0
    };
    for (g, &u) in gate[done..n].iter_mut().zip(&up[done..n]) {
        *g = gelu(*g) * u;
    }
}

/// [`gelu_glu`]'s NEON steps over the whole fours of `gate` (as long as `up`); returns how
/// many values it did.
#[cfg(target_arch = "aarch64")]
fn gelu_glu_neon(gate: &mut [f32], up: &[f32]) -> usize {
    use std::arch::aarch64::*;
    let table = gelu_table();
    let n = gate.len().min(up.len()) / 4 * 4;
    let (gp, upp) = (gate.as_mut_ptr(), up.as_ptr());
    // SAFETY: base Advanced SIMD; every access is inside `gate[..n]`/`up[..n]` (i + 4 ≤ n),
    // and the table has an entry for each of the 65536 f16 patterns.
    unsafe {
        let (lo, hi) = (vdupq_n_f32(-10.0), vdupq_n_f32(10.0));
        for i in (0..n).step_by(4) {
            let x = vld1q_f32(gp.add(i));
            let h = kernels::neon::f32x4_to_f16(x);
            let t = [
                *table.get_unchecked(vget_lane_u16::<0>(h) as usize),
                *table.get_unchecked(vget_lane_u16::<1>(h) as usize),
                *table.get_unchecked(vget_lane_u16::<2>(h) as usize),
                *table.get_unchecked(vget_lane_u16::<3>(h) as usize),
            ];
            let g = vbslq_f32(vcgeq_f32(x, hi), x, vld1q_f32(t.as_ptr()));
            let g = vbslq_f32(vcleq_f32(x, lo), vdupq_n_f32(0.0), g);
            vst1q_f32(gp.add(i), vmulq_f32(g, vld1q_f32(upp.add(i))));
        }
    }
    n
}

/// One entry of [`gelu`]'s table: the tanh-approximated GELU of an f16 input, computed in f32
/// and rounded to f16 (ggml's `ggml_table_gelu_f16`).
fn gelu_of_f16(h: half::f16) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    let h = h.to_f32();
    // libm's tanhf (the platform's differs between targets); the f16 rounding hides the change
    // from glibc's: every entry of the table is unchanged on x86.
    let g = 0.5 * h * (1.0 + libm::tanhf(SQRT_2_OVER_PI * h * (1.0 + COEF_A * h * h)));
    half::f16::from_f32(g).to_f32()
}

/// gpt-oss's clamped SwiGLU: `g = min(gate, limit)`, `u = clamp(up, ±limit)`,
/// `g·σ(alpha·g)·(u + 1)`.
#[inline]
pub fn swiglu_oai(gate: f32, up: f32, alpha: f32, limit: f32) -> f32 {
    let x = gate.min(limit);
    let y = up.clamp(-limit, limit);
    x / (1.0 + (alpha * -x).exp()) * (y + 1.0)
}

/// The gated activation of an FFN: `act(gate)·up` for SiLU and GELU, or gpt-oss's clamped
/// SwiGLU.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Glu {
    Silu,
    Gelu,
    SwigluOai {
        alpha: f32,
        limit: f32,
    },
    /// SiLU-GLU with both halves limited, as llama.cpp's `build_ffn` / `build_moe_ffn` limit
    /// them for bailingmoe3 (`swiglu_clamp_exp` / `_shexp`): `min(silu(g), limit) ·
    /// clamp(u, −limit, limit)` (not gpt-oss's clamped SwiGLU, another formula).
    SiluClamped {
        limit: f32,
    },
    /// SiLU-GLU of limited inputs, ggml's `swiglu_clamp` (deepseek4's
    /// `swiglu_clamp_exp` / `_shexp`): `silu(min(g, limit)) · clamp(u, −limit, limit)`.
    SiluOfClamped {
        limit: f32,
    },
}

impl Glu {
    /// `gate[i] = glu(gate[i], up[i])`. SiLU and the SwiGLU call the platform's `expf` per
    /// value, which no vector code reproduces bit for bit, so they stay scalar (the compiler
    /// vectorises the divisions and products around the calls); GELU has a NEON path.
    pub fn apply(self, gate: &mut [f32], up: &[f32]) {
        match self {
            Glu::Silu => {
                for (g, &u) in gate.iter_mut().zip(up) {
                    *g = silu(*g) * u;
                }
            }
            Glu::Gelu => gelu_glu(kernels::simd_level(), gate, up),
            Glu::SwigluOai { alpha, limit } => {
                for (g, &u) in gate.iter_mut().zip(up) {
                    *g = swiglu_oai(*g, u, alpha, limit);
                }
            }
            Glu::SiluClamped { limit } => {
                for (g, &u) in gate.iter_mut().zip(up) {
                    *g = silu(*g).min(limit) * u.clamp(-limit, limit);
                }
            }
            Glu::SiluOfClamped { limit } => {
                for (g, &u) in gate.iter_mut().zip(up) {
                    let x = g.min(limit);
                    *g = x / (1.0 + (-x).exp()) * u.clamp(-limit, limit);
                }
            }
        }
    }
}

/// Logit soft-capping `c·tanh(x/c)` in place (gemma's final logits), in ggml's order (scale,
/// tanh, scale); libm's `tanhf`, the same bits on every target.
pub fn softcap(v: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    for x in v.iter_mut() {
        *x = libm::tanhf(*x * inv) * cap;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_lanes_is_the_dot_product_in_its_lane_order() {
        for n in [0usize, 1, 7, 8, 9, 48, 64, 127, 128] {
            let a: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 17) as f32 - 8.0) * 0.37)
                .collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 11 % 13) as f32 - 6.0) * 1.3).collect();
            let mut lanes = [0f32; 8];
            for i in 0..n {
                lanes[i % 8] += a[i] * b[i];
            }
            let want = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
                + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
            assert_eq!(dot_lanes(&a, &b).to_bits(), want.to_bits(), "n={n}");
            let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot_lanes(&a, &b) as f64 - exact).abs() <= 1e-4 * (1.0 + exact.abs()));
        }
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_norms() {
        let r = Rope::plain(RopeKind::Neox, 8, 10_000.0);
        let mut c = Vec::new();
        r.cache(3, &mut c);
        let mut v: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        let n0: f32 = v.iter().map(|x| x * x).sum();
        r.apply(&c, &mut v);
        let n1: f32 = v.iter().map(|x| x * x).sum();
        assert!((n0 - n1).abs() < 1e-3);
        // Pair 0 (dims 0 and 4) turns by 3 radians.
        let (a, b) = (1.0f32, 5.0f32);
        assert!((v[0] - (a * 3f32.cos() - b * 3f32.sin())).abs() < 1e-5);
        // Position 0 is the identity.
        r.cache(0, &mut c);
        let mut w = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        r.apply(&c, &mut w);
        assert_eq!(w, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    }

    #[test]
    fn yarn_interpolates_low_frequencies_and_keeps_high_ones() {
        let y = Yarn {
            factor: 32.0,
            n_ctx_orig: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0,
        };
        let r = Rope::yarn(RopeKind::Neox, 64, 150_000.0, y);
        assert!(r.corr_dims[0] < r.corr_dims[1]);
        let mut c = Vec::new();
        r.cache(1000, &mut c);
        // The fastest pair is extrapolated (unscaled angle), the slowest interpolated (÷32);
        // the magnitude is YaRN's 1 + 0.1·ln(factor) (llama.cpp folds its reciprocal into
        // attn_factor and the kernel multiplies it back in).
        let angle = |i: usize| c[2 * i + 1].atan2(c[2 * i]);
        assert!((angle(0) - 1000f32.sin().atan2(1000f32.cos())).abs() < 1e-3);
        let slow = 1000.0 * 150_000f32.powf(-62.0 / 64.0) / 32.0;
        assert!((angle(31) - slow).abs() < 1e-4, "{} vs {slow}", angle(31));
        assert!((c[0].hypot(c[1]) - (1.0 + 0.1 * 32f32.ln())).abs() < 1e-5);
    }

    #[test]
    fn gelu_goes_through_f16_as_ggml_does() {
        assert_eq!(gelu(-11.0), 0.0);
        assert_eq!(gelu(12.0), 12.0);
        assert!((gelu(1.0) - 0.8413).abs() < 2e-3);
        let g = gelu(0.3);
        assert_eq!(half::f16::from_f32(g).to_f32(), g, "an f16 value");
    }

    /// The table lookup gives, bit for bit, the formula on the input rounded to f16 — over
    /// every f32 bit pattern's f16 neighbourhood that the table serves (a sweep of 2^24 f32
    /// values spread over the whole range, the ±10 edges and f16 rounding ties included).
    #[test]
    fn gelu_table_equals_the_formula_on_the_rounded_input() {
        let by_formula = |x: f32| {
            if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x
            } else {
                gelu_of_f16(half::f16::from_f32(x))
            }
        };
        let mut checked = 0u32;
        for hi in 0..(1u32 << 24) {
            let x = f32::from_bits(hi << 8 | (hi & 0xff));
            if !x.is_finite() {
                continue;
            }
            assert_eq!(gelu(x).to_bits(), by_formula(x).to_bits(), "gelu({x:e})");
            checked += 1;
        }
        for x in [
            -10.0f32, -9.999, 9.997, 9.999, 10.0, 0.0, -0.0, 1e-8, 65504.0, -65520.0,
        ] {
            assert_eq!(gelu(x).to_bits(), by_formula(x).to_bits(), "gelu({x:e})");
        }
        assert!(checked > 16_000_000);
    }

    /// The GELU-GLU gives the scalar bits at every SIMD level: every 2^8th f32 pattern (the
    /// ±10 edges, f16 rounding ties and overflow included) times a spread of `up` values.
    #[test]
    fn gelu_glu_gives_the_scalar_bits_at_every_level() {
        let mut gate: Vec<f32> = (0..1u32 << 24)
            .map(|hi| f32::from_bits(hi << 8 | (hi & 0xff)))
            .filter(|x| !x.is_nan())
            .collect();
        gate.extend([
            -10.0f32, -9.999, 9.997, 9.999, 10.0, 0.0, -0.0, 65504.0, -65520.0,
        ]);
        let up: Vec<f32> = (0..gate.len())
            .map(|i| ((i * 7919 % 2001) as f32 - 1000.0) * 0.013)
            .collect();
        let want: Vec<u32> = gate
            .iter()
            .zip(&up)
            .map(|(&g, &u)| (gelu(g) * u).to_bits())
            .collect();
        for level in kernels::SimdLevel::available() {
            // Odd lengths: the scalar tail after the vectors.
            for len in [gate.len(), 4099, 3] {
                let mut got = gate[..len].to_vec();
                gelu_glu(level, &mut got, &up[..len]);
                for (i, (g, w)) in got.iter().zip(&want[..len]).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        *w,
                        "{}: gelu({:e})·{}",
                        level.name(),
                        gate[i],
                        up[i]
                    );
                }
            }
            let mut nan = [f32::NAN; 4];
            gelu_glu(level, &mut nan, &[1.0; 4]);
            assert!(nan.iter().all(|x| x.is_nan()), "{}", level.name());
        }
    }

    #[test]
    fn swiglu_oai_clamps_both_inputs() {
        assert_eq!(
            swiglu_oai(100.0, 100.0, 1.702, 7.0),
            swiglu_oai(7.0, 7.0, 1.702, 7.0)
        );
        assert_eq!(
            swiglu_oai(1.0, -100.0, 1.702, 7.0),
            swiglu_oai(1.0, -7.0, 1.702, 7.0)
        );
        assert!((swiglu_oai(1.0, 0.0, 1.702, 7.0) - 1.0 / (1.0 + (-1.702f32).exp())).abs() < 1e-6);
    }

    /// Hashes of the bits every transcendental function of the forward pass, the sampler, the
    /// choice scores and the cache policies returns over a sweep: the same constants on every
    /// target (x86-64 glibc, aarch64 glibc and musl under qemu), so a target whose platform
    /// `expf`/`logf`/`powf` differ, or a change of libm, fails here rather than as a logit
    /// difference between builds. The sweep: every 4093rd f32 bit pattern (all exponents, both
    /// signs, subnormals, infinities and NaNs), then 2^19 values spread over [−12, 12]. (On the
    /// sweeps that chose these functions, the platform `tanhf`, `sinf`/`cosf` and the f64
    /// functions differed between targets on 0.03–1 % of such inputs.)
    #[test]
    fn transcendentals_give_the_same_bits_on_every_target() {
        fn mix(h: u64, bits: u64) -> u64 {
            (h ^ bits).wrapping_mul(0x0000_0100_0000_01b3)
        }
        // NaN results hash as one value: their payloads are not part of the contract.
        fn h32(h: u64, x: f32) -> u64 {
            let bits = if x.is_nan() { 0x7fc0_0000 } else { x.to_bits() };
            mix(h, bits as u64)
        }
        fn h64(h: u64, x: f64) -> u64 {
            let bits = if x.is_nan() {
                0x7ff8 << 48
            } else {
                x.to_bits()
            };
            mix(h, bits)
        }
        let wide = (0..=u32::MAX / 4093).map(|i| f32::from_bits(i * 4093));
        let dense = (0..1u32 << 19).map(|i| i as f32 * (24.0 / (1u32 << 19) as f32) - 12.0);
        let xs: Vec<f32> = wide.chain(dense).collect();
        let powers = [-2.0f32 / 128.0, -2.0 / 64.0, 0.25, 0.75, 1.5, -0.5];
        let mut got: Vec<(&str, u64)> = Vec::new();
        let mut put = |name, f: &dyn Fn(u64, f32) -> u64| {
            got.push((name, xs.iter().fold(0xcbf2_9ce4_8422_2325, |h, &x| f(h, x))));
        };
        put("f32 exp", &|h, x| h32(h, x.exp()));
        put("f32 ln", &|h, x| h32(h, x.ln()));
        put("f32 sqrt", &|h, x| h32(h, x.sqrt()));
        put("f32 powf", &|h, x| {
            powers.iter().fold(h, |h, &y| h32(h, x.powf(y)))
        });
        put("libm tanhf", &|h, x| h32(h, libm::tanhf(x)));
        put("libm sincosf", &|h, x| {
            let (s, c) = libm::sincosf(x);
            h32(h32(h, s), c)
        });
        put("libm exp", &|h, x| h64(h, libm::exp(x as f64)));
        put("libm log", &|h, x| h64(h, libm::log(x as f64)));
        put("libm pow", &|h, x| h64(h, libm::pow(0.005, 1.0 / x as f64)));
        put("libm exp2 log2", &|h, x| {
            h64(h64(h, libm::exp2(x as f64)), libm::log2(x as f64))
        });
        // The forward pass's own uses: the GELU table and a YaRN rope cache.
        let gelu_table = (0..=u16::MAX).fold(0xcbf2_9ce4_8422_2325, |h, b| {
            h32(h, gelu_of_f16(half::f16::from_bits(b)))
        });
        got.push(("gelu table", gelu_table));
        let y = Yarn {
            factor: 32.0,
            n_ctx_orig: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0,
        };
        let rope = Rope::yarn(RopeKind::Neox, 64, 150_000.0, y);
        let mut cache = Vec::new();
        let rope_hash = (0..4096u32)
            .step_by(7)
            .fold(0xcbf2_9ce4_8422_2325, |h, pos| {
                rope.cache(pos, &mut cache);
                cache.iter().fold(h, |h, &c| h32(h, c))
            });
        got.push(("rope cache", rope_hash));
        let want: &[(&str, u64)] = &[
            ("f32 exp", 0xde57243ab132444f),
            ("f32 ln", 0x45e5f775434168cb),
            ("f32 sqrt", 0xabaa13095337d8a8),
            ("f32 powf", 0x9407074c1e786237),
            ("libm tanhf", 0x93cb8b6740ef89ca),
            ("libm sincosf", 0xe64153a166ab252f),
            ("libm exp", 0xe531c2a21f81dd5d),
            ("libm log", 0xe043b752c580c780),
            ("libm pow", 0xe36caa2cca7dfe18),
            ("libm exp2 log2", 0x4b194e575a7ece94),
            ("gelu table", 0x37f6008cfa23c325),
            ("rope cache", 0x36e93c2e4503f48f),
        ];
        for ((name, hash), (_, expected)) in got.iter().zip(want) {
            assert_eq!(
                hash, expected,
                "{name}: {hash:#018x}, pinned {expected:#018x}"
            );
        }
        assert_eq!(got.len(), want.len());
    }

    #[test]
    fn softcap_bounds_logits() {
        let mut v = [1000.0f32, -1000.0, 0.0, 3.0];
        softcap(&mut v, 30.0);
        assert!((v[0] - 30.0).abs() < 1e-4 && (v[1] + 30.0).abs() < 1e-4);
        assert_eq!(v[2], 0.0);
        assert!((v[3] - 30.0 * 0.1f32.tanh()).abs() < 1e-5);
    }
}
