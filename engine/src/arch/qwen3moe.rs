//! `qwen3moe`: hyper-parameters from GGUF metadata (checked once, the missing key named),
//! tensor names verbatim, and the layer forward split into a dense step, a router step and
//! an expert step, so the shared core can stream experts in between.
//!
//! Math (see `../shared/spec/qwen3moe-gguf.md`): RMSNorm; GQA attention with per-head q/k
//! RMSNorm and NeoX rotary embedding; router softmax over all experts → top-k →
//! renormalise; SiLU-gated experts over stacked `ffn_{gate,up,down}_exps`; weighted sum in
//! top-k order; final norm; output head (tied to `token_embd` when `output.weight` is absent).

use super::ArchError;
use crate::gguf::{GgmlType, GgufFile, TensorInfo};
use crate::kernels::{self, ActBuf, ActFormat, ThreadPool};
use std::sync::Arc;

pub const ARCH: &str = "qwen3moe";

/// Hyper-parameters, read and checked once at load.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    pub n_layer: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub d_model: usize,
    pub n_ff_exp: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ctx_train: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub n_vocab: usize,
}

fn key_err(f: &GgufFile, key: &str, what: impl Into<String>) -> ArchError {
    ArchError::Key {
        file: f.path().display().to_string(),
        key: key.into(),
        what: what.into(),
    }
}

fn req_u(f: &GgufFile, key: &str) -> Result<usize, ArchError> {
    let v = f
        .get(key)
        .ok_or_else(|| key_err(f, key, "is missing (required for qwen3moe)"))?;
    // Some files store per-layer arrays for counts; all entries must agree for us.
    if let Some(arr) = v.as_array() {
        let first = arr
            .first()
            .and_then(|x| x.as_u64())
            .ok_or_else(|| key_err(f, key, "is an empty or non-integer array"))?;
        if arr.iter().any(|x| x.as_u64() != Some(first)) {
            return Err(key_err(
                f,
                key,
                "varies per layer, which this build does not support",
            ));
        }
        return Ok(first as usize);
    }
    let n = v
        .as_u64()
        .ok_or_else(|| key_err(f, key, format!("is {v}, expected a non-negative integer")))?;
    usize::try_from(n).map_err(|_| key_err(f, key, "does not fit this machine's usize"))
}

fn opt_u(f: &GgufFile, key: &str) -> Result<Option<usize>, ArchError> {
    if f.get(key).is_none() {
        return Ok(None);
    }
    req_u(f, key).map(Some)
}

fn opt_f(f: &GgufFile, key: &str, default: f32) -> Result<f32, ArchError> {
    match f.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| key_err(f, key, format!("is {v}, expected a number"))),
    }
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<HParams, ArchError> {
        let k = |n: &str| format!("{ARCH}.{n}");
        let n_layer = req_u(f, &k("block_count"))?;
        let d_model = req_u(f, &k("embedding_length"))?;
        let n_head = req_u(f, &k("attention.head_count"))?;
        let n_ctx_train = req_u(f, &k("context_length"))?;
        let n_expert = req_u(f, &k("expert_count"))?;
        let n_expert_used = req_u(f, &k("expert_used_count"))?;
        let rms_eps = f
            .get(&k("attention.layer_norm_rms_epsilon"))
            .ok_or_else(|| {
                key_err(
                    f,
                    &k("attention.layer_norm_rms_epsilon"),
                    "is missing (required for qwen3moe)",
                )
            })?
            .as_f64()
            .ok_or_else(|| key_err(f, &k("attention.layer_norm_rms_epsilon"), "is not a number"))?
            as f32;
        let n_head_kv = opt_u(f, &k("attention.head_count_kv"))?.unwrap_or(n_head);
        if n_head == 0 || d_model == 0 || n_layer == 0 {
            return Err(key_err(
                f,
                &k("attention.head_count"),
                "block_count, embedding_length and head_count must be positive",
            ));
        }
        let head_dim = opt_u(f, &k("attention.key_length"))?.unwrap_or(d_model / n_head);
        let v_dim = opt_u(f, &k("attention.value_length"))?.unwrap_or(head_dim);
        if v_dim != head_dim {
            return Err(key_err(
                f,
                &k("attention.value_length"),
                format!("{v_dim} differs from key_length {head_dim}; unsupported"),
            ));
        }
        let n_ff_exp = match opt_u(f, &k("expert_feed_forward_length"))? {
            Some(n) => n,
            None => {
                let ff = req_u(f, &k("feed_forward_length"))?;
                if n_expert_used == 0 {
                    return Err(key_err(f, &k("expert_used_count"), "is 0"));
                }
                ff / n_expert_used
            }
        };
        let rope_base = opt_f(f, &k("rope.freq_base"), 10_000.0)?;
        if let Some(rd) = opt_u(f, &k("rope.dimension_count"))? {
            if rd != head_dim {
                return Err(key_err(f, &k("rope.dimension_count"), format!("{rd} differs from the head dim {head_dim}; partial rotary is not supported")));
            }
        }
        if n_expert == 0 {
            return Err(ArchError::NotMoe {
                file: f.path().display().to_string(),
                arch: ARCH.into(),
            });
        }
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(key_err(
                f,
                &k("expert_used_count"),
                format!("{n_expert_used}, expected 1..={n_expert}"),
            ));
        }
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(key_err(
                f,
                &k("attention.head_count_kv"),
                format!("{n_head_kv} must divide head_count {n_head}"),
            ));
        }
        if head_dim % 2 != 0 {
            return Err(key_err(
                f,
                &k("attention.key_length"),
                format!("{head_dim} must be even for rotary embedding"),
            ));
        }
        let embd = f
            .tensor("token_embd.weight")
            .ok_or_else(|| ArchError::Tensor {
                file: f.path().display().to_string(),
                tensor: "token_embd.weight".into(),
                what: "is missing".into(),
            })?;
        let n_vocab = embd.dims.get(1).copied().unwrap_or(0) as usize;
        Ok(HParams {
            n_layer,
            n_expert,
            n_expert_used,
            d_model,
            n_ff_exp,
            n_head,
            n_head_kv,
            head_dim,
            n_ctx_train,
            rope_base,
            rms_eps,
            n_vocab,
        })
    }
}

/// A 2-D weight matrix view: `rows` rows of `cols` elements, GGUF row-major.
#[derive(Copy, Clone, Debug)]
pub struct Mat {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    ptr: *const u8,
    len: usize,
    /// Where the bytes are in the file (for `--dense-weights anon` and residency probes).
    pub shard: u16,
    pub file_offset: u64,
}

// SAFETY: a `Mat` points into memory owned by the `Weights` that made it (the model's
// memory map or its anonymous dense buffers), which is immutable for the model's life.
unsafe impl Send for Mat {}
unsafe impl Sync for Mat {}

impl Mat {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: see the Send/Sync note; ptr/len come from a live slice of the owner.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn from_tensor(t: &TensorInfo, rows: usize, cols: usize, s: &[u8]) -> Mat {
        Mat {
            ty: t.ty,
            rows,
            cols,
            ptr: s.as_ptr(),
            len: s.len(),
            shard: t.shard,
            file_offset: t.offset,
        }
    }
    /// The address range of the bytes (for residency probes).
    pub fn range(&self) -> (*const u8, usize) {
        (self.ptr, self.len)
    }
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols as u64).unwrap_or(0) as usize
    }
}

/// Where one expert's three projections are, inside a stacked tensor.
#[derive(Clone, Debug)]
pub struct ExpertTensor {
    pub info: TensorInfo,
    /// Bytes per expert.
    pub stride: u64,
    /// Rows per expert and their length.
    pub rows: usize,
    pub cols: usize,
}

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub q: Mat,
    pub k: Mat,
    pub v: Mat,
    pub o: Mat,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub router: Mat,
    /// gate, up, down
    pub exps: [ExpertTensor; 3],
}

/// The dense (always resident) weights plus the location of every expert.
pub struct Weights {
    pub hp: HParams,
    pub embd: Mat,
    pub output: Mat,
    pub output_norm: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    /// Keeps the memory map (and any anonymous copies) alive behind every `Mat`.
    _file: Arc<GgufFile>,
    /// Anonymous copies of the dense matrices under `--dense-weights anon`.
    anon: Vec<crate::dense::AnonBuf>,
}

fn tensor<'a>(f: &'a GgufFile, name: &str) -> Result<&'a TensorInfo, ArchError> {
    f.tensor(name).ok_or_else(|| ArchError::Tensor {
        file: f.path().display().to_string(),
        tensor: name.into(),
        what: "is missing".into(),
    })
}

fn check_dims(f: &GgufFile, t: &TensorInfo, want: &[usize]) -> Result<(), ArchError> {
    let got: Vec<usize> = t.dims.iter().map(|&d| d as usize).collect();
    if got != want {
        return Err(ArchError::Tensor {
            file: f.path().display().to_string(),
            tensor: t.name.clone(),
            what: format!("has shape {got:?}, expected {want:?}"),
        });
    }
    Ok(())
}

fn check_type(f: &GgufFile, t: &TensorInfo, allowed: &[GgmlType]) -> Result<(), ArchError> {
    if !allowed.contains(&t.ty) {
        return Err(ArchError::Tensor {
            file: f.path().display().to_string(),
            tensor: t.name.clone(),
            what: format!(
                "has type {}, which this build has no kernel for (supported: {})",
                t.ty,
                allowed
                    .iter()
                    .map(|t| t.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        });
    }
    Ok(())
}

fn mat(f: &GgufFile, name: &str, cols: usize, rows: usize) -> Result<Mat, ArchError> {
    let t = tensor(f, name)?;
    check_dims(f, t, &[cols, rows])?;
    check_type(f, t, kernels::weight_types())?;
    Ok(Mat::from_tensor(t, rows, cols, f.tensor_data(t)))
}

fn vector(f: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>, ArchError> {
    let t = tensor(f, name)?;
    check_dims(f, t, &[n])?;
    check_type(f, t, &[GgmlType::F32, GgmlType::F16, GgmlType::BF16])?;
    let mut out = vec![0f32; n];
    kernels::dequantize_row(t.ty, f.tensor_data(t), &mut out).map_err(|e| ArchError::Tensor {
        file: f.path().display().to_string(),
        tensor: name.into(),
        what: e.to_string(),
    })?;
    Ok(out)
}

fn experts(
    f: &GgufFile,
    name: &str,
    cols: usize,
    rows: usize,
    n_expert: usize,
) -> Result<ExpertTensor, ArchError> {
    let t = tensor(f, name)?;
    check_dims(f, t, &[cols, rows, n_expert])?;
    check_type(f, t, kernels::weight_types())?;
    Ok(ExpertTensor {
        info: t.clone(),
        stride: t.n_bytes / n_expert as u64,
        rows,
        cols,
    })
}

impl Weights {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>) -> Result<Weights, ArchError> {
        let f = &*file;
        match f.architecture() {
            Some(ARCH) => {}
            Some(other) => {
                return Err(ArchError::Unsupported {
                    file: f.path().display().to_string(),
                    arch: other.into(),
                    supported: super::SUPPORTED
                        .iter()
                        .map(|s| s.0)
                        .collect::<Vec<_>>()
                        .join(", "),
                })
            }
            None => return Err(key_err(f, "general.architecture", "is missing")),
        }
        let hp = HParams::from_gguf(f)?;
        let d = hp.d_model;
        let qd = hp.n_head * hp.head_dim;
        let kvd = hp.n_head_kv * hp.head_dim;
        let embd = mat(f, "token_embd.weight", d, hp.n_vocab)?;
        let output = if f.tensor("output.weight").is_some() {
            mat(f, "output.weight", d, hp.n_vocab)?
        } else {
            embd
        };
        let output_norm = vector(f, "output_norm.weight", d)?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(LayerWeights {
                attn_norm: vector(f, &n("attn_norm"), d)?,
                q: mat(f, &n("attn_q"), d, qd)?,
                k: mat(f, &n("attn_k"), d, kvd)?,
                v: mat(f, &n("attn_v"), d, kvd)?,
                o: mat(f, &n("attn_output"), qd, d)?,
                q_norm: vector(f, &n("attn_q_norm"), hp.head_dim)?,
                k_norm: vector(f, &n("attn_k_norm"), hp.head_dim)?,
                ffn_norm: vector(f, &n("ffn_norm"), d)?,
                router: mat(f, &n("ffn_gate_inp"), d, hp.n_expert)?,
                exps: [
                    experts(f, &n("ffn_gate_exps"), d, hp.n_ff_exp, hp.n_expert)?,
                    experts(f, &n("ffn_up_exps"), d, hp.n_ff_exp, hp.n_expert)?,
                    experts(f, &n("ffn_down_exps"), hp.n_ff_exp, d, hp.n_expert)?,
                ],
            });
        }
        Ok(Weights {
            hp,
            embd,
            output,
            output_norm,
            layers,
            _file: file,
            anon: Vec::new(),
        })
    }

    /// The resident bytes of expert `e`'s projection `p` (0 gate, 1 up, 2 down), from the map.
    pub fn resident_expert(&self, layer: usize, e: usize, p: usize) -> &[u8] {
        let x = &self.layers[layer].exps[p];
        let data = self._file.tensor_data(&x.info);
        let s = x.stride as usize;
        &data[e * s..(e + 1) * s]
    }

    /// Every dense matrix, mutably (embedding, head, attention, routers).
    fn dense_mats_mut(&mut self) -> Vec<&mut Mat> {
        let tied = self.output.ptr == self.embd.ptr;
        let mut v: Vec<&mut Mat> = vec![&mut self.embd];
        if !tied {
            v.push(&mut self.output);
        }
        for l in &mut self.layers {
            v.extend([&mut l.q, &mut l.k, &mut l.v, &mut l.o, &mut l.router]);
        }
        v
    }

    /// Address ranges of the dense matrices as they are now (map or anonymous copies).
    pub fn dense_ranges(&self) -> Vec<(*const u8, usize)> {
        let mut v = vec![self.embd.range(), self.output.range()];
        for l in &self.layers {
            v.extend([
                l.q.range(),
                l.k.range(),
                l.v.range(),
                l.o.range(),
                l.router.range(),
            ]);
        }
        v
    }

    /// Apply a `--dense-weights` policy: `mmap` keeps the map; `warm` reads the dense bytes
    /// once, sequentially, so the first tokens do not fault them in one page at a time;
    /// `anon` copies them (O_DIRECT where the filesystem allows) into anonymous memory and
    /// drops the map's pages, so under pressure the kernel swaps them (zram) instead of
    /// re-reading flash. Returns the bytes affected.
    pub fn apply_dense_mode(&mut self, mode: crate::dense::DenseMode) -> Result<u64, ArchError> {
        use crate::dense::DenseMode;
        let file = self._file.clone();
        let paths: Vec<std::path::PathBuf> =
            file.shard_paths().iter().map(|p| p.to_path_buf()).collect();
        let mut total = 0u64;
        match mode {
            DenseMode::Mmap => {}
            DenseMode::Warm => {
                for m in self.dense_mats_mut() {
                    total += crate::dense::warm(m.bytes()) as u64;
                }
            }
            DenseMode::Anon => {
                let mut bufs = Vec::new();
                for m in self.dense_mats_mut() {
                    let path = &paths[m.shard as usize];
                    let buf =
                        crate::dense::AnonBuf::read(path, m.file_offset, m.len).map_err(|e| {
                            ArchError::Tensor {
                                file: path.display().to_string(),
                                tensor: format!("dense bytes at offset {}", m.file_offset),
                                what: format!("--dense-weights anon: {e}"),
                            }
                        })?;
                    let old = m.bytes();
                    crate::dense::drop_map_pages(old);
                    m.ptr = buf.data().as_ptr();
                    total += m.len as u64;
                    bufs.push(buf);
                }
                // A tied head shares the embedding's copy.
                if self.output.file_offset == self.embd.file_offset
                    && self.output.shard == self.embd.shard
                {
                    self.output.ptr = self.embd.ptr;
                }
                self.anon = bufs;
            }
        }
        Ok(total)
    }

    pub fn file(&self) -> &Arc<GgufFile> {
        &self._file
    }
}

/// The router's choice for one row of the batch.
#[derive(Clone, Debug, Default)]
pub struct RouteOut {
    /// Rows of the batch this layer routes (all, or the output rows at the last layer).
    pub rows: Vec<u32>,
    pub k: usize,
    /// `rows.len() × k` expert ids, rank order.
    pub ids: Vec<u32>,
    /// `rows.len() × k` final weights (renormalised).
    pub weights: Vec<f32>,
    /// `rows.len() × n_expert` router probabilities (softmax over all experts).
    pub probs: Vec<f32>,
}

/// Per-session mutable state: KV cache and scratch buffers, sized once.
pub struct State {
    pub n_ctx: usize,
    /// Values per position per layer in the KV (`n_head_kv × head_dim`).
    kv_dim: usize,
    k_cache: Vec<f32>,
    v_cache: Vec<f32>,
    /// Batch rows in flight.
    n_rows: usize,
    positions: Vec<u32>,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
    /// Rows the FFN runs for at the current layer.
    ffn_rows: Vec<u32>,
    /// `n_rows × k × d` per-rank expert outputs, already weighted.
    moe: Vec<f32>,
    moe_filled: Vec<bool>,
    acts: Vec<ActBuf>,
    act2: Vec<ActBuf>,
    /// The FFN rows' input (`h`) quantised once per layer for the experts' gate (and up)
    /// projections, shared by every expert a row is routed to; `ffn_acts_for` names the layer
    /// and format it holds (`None`: stale).
    ffn_acts: Vec<ActBuf>,
    ffn_acts_for: Option<(usize, ActFormat)>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    scores: Vec<f32>,
    /// Expert prediction: the router input (FFN-normed hidden state) of the batch's last
    /// routed row at the MoE layer routed last (`pred_layer`), kept until the next `route`.
    pred_h: Vec<f32>,
    pred_layer: Option<usize>,
    pred_acts: Vec<ActBuf>,
    pred_probs: Vec<f32>,
    pred_order: Vec<u32>,
    /// Rows whose logits are wanted at the end of the batch.
    out_rows: Vec<u32>,
    pub logits: Vec<f32>,
}

/// A copy of the KV rows of positions `0..n` of every layer: the whole sequence state of this
/// architecture (attention only, no recurrent state), as a decide keeps it after its prefix.
#[derive(Debug, Default)]
pub struct KvSnapshot {
    n: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvSnapshot {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.n
    }
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
    /// Bytes of memory held.
    pub fn bytes(&self) -> u64 {
        ((self.k.capacity() + self.v.capacity()) * std::mem::size_of::<f32>()) as u64
    }
}

impl State {
    /// Layers in the KV.
    fn kv_layers(&self) -> usize {
        self.k_cache
            .len()
            .checked_div(self.n_ctx * self.kv_dim)
            .unwrap_or(0)
    }

    /// Copy the KV rows of positions `0..n` (every layer) into `into`, reusing its buffers.
    pub fn snapshot_kv(&self, n: usize, into: &mut KvSnapshot) -> Result<(), ArchError> {
        if n > self.n_ctx {
            return Err(ArchError::Key {
                file: String::new(),
                key: "n_ctx".into(),
                what: format!(
                    "a snapshot of {n} positions is past the context size {}",
                    self.n_ctx
                ),
            });
        }
        let (per_layer, chunk) = (self.n_ctx * self.kv_dim, n * self.kv_dim);
        into.n = n;
        into.k.clear();
        into.v.clear();
        for l in 0..self.kv_layers() {
            let base = l * per_layer;
            into.k.extend_from_slice(&self.k_cache[base..base + chunk]);
            into.v.extend_from_slice(&self.v_cache[base..base + chunk]);
        }
        // Hold what this snapshot needs, not what a longer earlier one did.
        into.k.shrink_to_fit();
        into.v.shrink_to_fit();
        Ok(())
    }

    /// Put `snap`'s rows back: positions `0..snap.len()` of every layer read exactly as they
    /// did when it was taken, whatever was fed since.
    pub fn restore_kv(&mut self, snap: &KvSnapshot) -> Result<(), ArchError> {
        let n_layer = self.kv_layers();
        let (per_layer, chunk) = (self.n_ctx * self.kv_dim, snap.n * self.kv_dim);
        if snap.n > self.n_ctx || snap.k.len() != n_layer * chunk || snap.v.len() != n_layer * chunk
        {
            return Err(ArchError::Key {
                file: String::new(),
                key: "kv snapshot".into(),
                what: format!(
                    "{} positions in {} values do not fit {n_layer} layers of width {}",
                    snap.n,
                    snap.k.len(),
                    self.kv_dim
                ),
            });
        }
        for l in 0..n_layer {
            let base = l * per_layer;
            self.k_cache[base..base + chunk].copy_from_slice(&snap.k[l * chunk..(l + 1) * chunk]);
            self.v_cache[base..base + chunk].copy_from_slice(&snap.v[l * chunk..(l + 1) * chunk]);
        }
        Ok(())
    }
}

struct SendPtr<T>(*mut T);
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    // Square in f32, then widen, as llama.cpp does: the bits of the norm follow its order.
    let ss: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let scale = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

fn rope_neox(v: &mut [f32], pos: u32, base: f32) {
    let hd = v.len();
    let half = hd / 2;
    for i in 0..half {
        let theta = pos as f32 * base.powf(-2.0 * i as f32 / hd as f32);
        let (s, c) = theta.sin_cos();
        let (a, b) = (v[i], v[i + half]);
        v[i] = a * c - b * s;
        v[i + half] = a * s + b * c;
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// qwen3moe's expert selection for one row: `p` (router logits on entry) becomes the softmax
/// over all experts; the top `k` by probability (ties to the lower id) go to `ids` in rank
/// order with weights `p_j / max(Σ top-k p, 6.1035e-5)`. `order` is scratch (`p.len()` wide).
/// The router and the predictor both call this, so a prediction is the router's arithmetic.
fn select_top_k(
    p: &mut [f32],
    k: usize,
    order: &mut Vec<u32>,
    ids: &mut [u32],
    weights: &mut [f32],
) {
    let mx = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for v in p.iter_mut() {
        *v = (*v - mx).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    p.iter_mut().for_each(|v| *v *= inv);
    order.clear();
    order.extend(0..p.len() as u32);
    // Descending by probability; ties by the lower id, so the order is total.
    order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]).then(a.cmp(&b)));
    let top = &order[..k];
    let s: f32 = top.iter().map(|&e| p[e as usize]).sum();
    let s = s.max(6.103_515_6e-5);
    for (j, &e) in top.iter().enumerate() {
        ids[j] = e;
        weights[j] = p[e as usize] / s;
    }
}

/// The model bound to a compute pool: the forward pass in steps.
pub struct Qwen3Moe {
    pub w: Weights,
    pub pool: ThreadPool,
    /// Experts the router keeps per token: the model's `expert_used_count`, or a smaller one
    /// by `set_top_k`. `bmoe-cli` leaves it whole and narrows `--n-expert-used` in the core's
    /// router hook, resident and streamed alike, with the same renormalisation (same bits).
    top_k: usize,
    /// `--check-finite`: stop at the first layer intermediate holding a NaN or infinity.
    check_finite: bool,
}

fn kerr(e: kernels::KernelError) -> ArchError {
    ArchError::Tensor {
        file: String::new(),
        tensor: String::new(),
        what: format!("kernel: {e}"),
    }
}

/// Quantize `n` input rows of `cols` values for dot products with weights of type `ty`, once
/// for the batch, the rows split across the pool.
fn prepare_acts(
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
/// matvec for a single token, one batched matmul (same bits per row) otherwise.
fn mul_prepared<A: std::borrow::Borrow<ActBuf> + Sync>(
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

impl Qwen3Moe {
    pub fn new(w: Weights, threads: usize) -> Qwen3Moe {
        let top_k = w.hp.n_expert_used;
        Qwen3Moe {
            w,
            pool: ThreadPool::new(threads.max(1)),
            top_k,
            check_finite: false,
        }
    }

    /// Check every layer's intermediates for NaN and infinity (`--check-finite`): one pass
    /// over the hidden state per check, to name the first layer and tensor that breaks.
    pub fn set_check_finite(&mut self, on: bool) {
        self.check_finite = on;
    }

    /// Under `--check-finite`, an error when `data` (rows of `row_len` values; row `i` is
    /// batch row `rows[i]`, or `i` when `rows` is `None`) holds a non-finite value.
    fn check(
        &self,
        st: &State,
        layer: usize,
        tensor: &'static str,
        data: &[f32],
        row_len: usize,
        rows: Option<&[u32]>,
    ) -> Result<(), ArchError> {
        if !self.check_finite {
            return Ok(());
        }
        let Some((count, first)) = crate::finite::non_finite(data) else {
            return Ok(());
        };
        let row = first / row_len.max(1);
        let batch_row = rows.map_or(row, |r| r.get(row).copied().unwrap_or(0) as usize);
        Err(ArchError::NonFinite {
            layer,
            tensor,
            position: st.positions.get(batch_row).copied().unwrap_or(0),
            count,
            total: data.len(),
        })
    }

    /// Keep only the top `k` experts per token (1..=the model's `expert_used_count`).
    pub fn set_top_k(&mut self, k: usize) {
        self.top_k = k.clamp(1, self.w.hp.n_expert_used);
    }

    pub fn hp(&self) -> &HParams {
        &self.w.hp
    }

    pub fn new_state(&self, n_ctx: usize) -> State {
        let hp = &self.w.hp;
        let kvd = hp.n_head_kv * hp.head_dim;
        State {
            n_ctx,
            kv_dim: kvd,
            k_cache: vec![0.0; hp.n_layer * n_ctx * kvd],
            v_cache: vec![0.0; hp.n_layer * n_ctx * kvd],
            n_rows: 0,
            positions: Vec::new(),
            x: Vec::new(),
            h: Vec::new(),
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            att: Vec::new(),
            tmp: Vec::new(),
            ffn_rows: Vec::new(),
            moe: Vec::new(),
            moe_filled: Vec::new(),
            acts: Vec::new(),
            act2: Vec::new(),
            ffn_acts: Vec::new(),
            ffn_acts_for: None,
            gate: Vec::new(),
            up: Vec::new(),
            down: Vec::new(),
            scores: Vec::new(),
            pred_h: Vec::new(),
            pred_layer: None,
            pred_acts: Vec::new(),
            pred_probs: Vec::new(),
            pred_order: Vec::new(),
            out_rows: Vec::new(),
            logits: Vec::new(),
        }
    }

    fn matmul_rows(
        &self,
        m: &Mat,
        input: &[f32],
        n: usize,
        acts: &mut Vec<ActBuf>,
        out: &mut [f32],
    ) -> Result<(), ArchError> {
        prepare_acts(&self.pool, m.ty, input, n, m.cols, acts)?;
        mul_prepared(&self.pool, m.ty, m.bytes(), m.rows, m.cols, &acts[..n], out)
    }

    /// Start a batch: embed `tokens` at `positions`; `out_rows` are the rows whose logits
    /// `head` will produce (the last row for generation; all rows for `--logits-out`).
    pub fn begin(
        &self,
        st: &mut State,
        tokens: &[u32],
        positions: &[u32],
        out_rows: &[u32],
    ) -> Result<(), ArchError> {
        let hp = &self.w.hp;
        let d = hp.d_model;
        let n = tokens.len();
        if let Some(&p) = positions.iter().max() {
            if p as usize >= st.n_ctx {
                return Err(ArchError::Key {
                    file: String::new(),
                    key: "n_ctx".into(),
                    what: format!("position {p} is past the context size {}", st.n_ctx),
                });
            }
        }
        st.n_rows = n;
        st.pred_layer = None;
        st.positions.clear();
        st.positions.extend_from_slice(positions);
        st.out_rows.clear();
        st.out_rows.extend_from_slice(out_rows);
        st.x.resize(n * d, 0.0);
        let rb = self.w.embd.row_bytes();
        for (r, &t) in tokens.iter().enumerate() {
            if t as usize >= hp.n_vocab {
                return Err(ArchError::Key {
                    file: String::new(),
                    key: "token".into(),
                    what: format!("id {t} is outside the vocabulary of {}", hp.n_vocab),
                });
            }
            let src = &self.w.embd.bytes()[t as usize * rb..(t as usize + 1) * rb];
            kernels::dequantize_row(self.w.embd.ty, src, &mut st.x[r * d..(r + 1) * d])
                .map_err(kerr)?;
        }
        self.check(st, 0, "inp_embd", &st.x, d, None)
    }

    /// Attention for every row, then the FFN norm of the rows the FFN will run for.
    pub fn dense(&self, st: &mut State, layer: usize) -> Result<(), ArchError> {
        let hp = &self.w.hp;
        let lw = &self.w.layers[layer];
        let (d, hd, nh, nkv) = (hp.d_model, hp.head_dim, hp.n_head, hp.n_head_kv);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let n = st.n_rows;
        st.h.resize(n * d, 0.0);
        for r in 0..n {
            rmsnorm(
                &st.x[r * d..(r + 1) * d],
                &lw.attn_norm,
                hp.rms_eps,
                &mut st.h[r * d..(r + 1) * d],
            );
        }
        st.q.resize(n * qd, 0.0);
        st.k.resize(n * kvd, 0.0);
        st.v.resize(n * kvd, 0.0);
        let mut acts = std::mem::take(&mut st.acts);
        let h = std::mem::take(&mut st.h);
        self.matmul_rows(&lw.q, &h, n, &mut acts, &mut st.q)?;
        self.matmul_rows(&lw.k, &h, n, &mut acts, &mut st.k)?;
        self.matmul_rows(&lw.v, &h, n, &mut acts, &mut st.v)?;
        st.h = h;
        let mut tmp = vec![0f32; hd];
        for r in 0..n {
            let pos = st.positions[r];
            for hh in 0..nh {
                let s = &mut st.q[r * qd + hh * hd..r * qd + (hh + 1) * hd];
                rmsnorm(s, &lw.q_norm, hp.rms_eps, &mut tmp);
                s.copy_from_slice(&tmp);
                rope_neox(s, pos, hp.rope_base);
            }
            for hh in 0..nkv {
                let s = &mut st.k[r * kvd + hh * hd..r * kvd + (hh + 1) * hd];
                rmsnorm(s, &lw.k_norm, hp.rms_eps, &mut tmp);
                s.copy_from_slice(&tmp);
                rope_neox(s, pos, hp.rope_base);
            }
            let base = (layer * st.n_ctx + pos as usize) * kvd;
            st.k_cache[base..base + kvd].copy_from_slice(&st.k[r * kvd..(r + 1) * kvd]);
            st.v_cache[base..base + kvd].copy_from_slice(&st.v[r * kvd..(r + 1) * kvd]);
        }
        // Attention, parallel over (row, head); each task writes its own output slice.
        st.att.resize(n * qd, 0.0);
        let max_pos = st.positions.iter().copied().max().unwrap_or(0) as usize + 1;
        let n_threads = self.pool.n_threads();
        st.scores.resize(n_threads.max(1) * max_pos, 0.0);
        let scale = 1.0 / (hd as f32).sqrt();
        let group = nh / nkv;
        let kc = &st.k_cache[layer * st.n_ctx * kvd..(layer + 1) * st.n_ctx * kvd];
        let vc = &st.v_cache[layer * st.n_ctx * kvd..(layer + 1) * st.n_ctx * kvd];
        let q = &st.q;
        let positions = &st.positions;
        let att = SendPtr(st.att.as_mut_ptr());
        let scores_all = SendPtr(st.scores.as_mut_ptr());
        let n_tasks = n * nh;
        let per = n_tasks.div_ceil(n_threads.max(1));
        self.pool.run(n_threads.max(1), &|t| {
            let lo = t * per;
            let hi = ((t + 1) * per).min(n_tasks);
            // SAFETY: thread t owns scores[t*max_pos..] and the att slices of tasks lo..hi.
            let scores = unsafe {
                std::slice::from_raw_parts_mut(scores_all.get().add(t * max_pos), max_pos)
            };
            for task in lo..hi {
                let (r, hh) = (task / nh, task % nh);
                let pos = positions[r] as usize;
                let qv = &q[r * qd + hh * hd..r * qd + (hh + 1) * hd];
                let kh = hh / group;
                let mut mx = f32::NEG_INFINITY;
                for (p, sc) in scores.iter_mut().enumerate().take(pos + 1) {
                    let kv = &kc[p * kvd + kh * hd..p * kvd + (kh + 1) * hd];
                    let s: f32 = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale;
                    *sc = s;
                    mx = mx.max(s);
                }
                let mut sum = 0f64;
                for sc in scores.iter_mut().take(pos + 1) {
                    *sc = (*sc - mx).exp();
                    sum += *sc as f64;
                }
                let inv = (1.0 / sum) as f32;
                let out =
                    unsafe { std::slice::from_raw_parts_mut(att.get().add(r * qd + hh * hd), hd) };
                out.iter_mut().for_each(|o| *o = 0.0);
                for (p, &sc) in scores.iter().enumerate().take(pos + 1) {
                    let w = sc * inv;
                    let vv = &vc[p * kvd + kh * hd..p * kvd + (kh + 1) * hd];
                    for (o, &x) in out.iter_mut().zip(vv) {
                        *o += w * x;
                    }
                }
            }
        });
        st.tmp.resize(n * d, 0.0);
        let att_v = std::mem::take(&mut st.att);
        let mut tmp = std::mem::take(&mut st.tmp);
        self.matmul_rows(&lw.o, &att_v, n, &mut acts, &mut tmp)?;
        st.att = att_v;
        for (x, o) in st.x.iter_mut().zip(&tmp) {
            *x += *o;
        }
        st.tmp = tmp;
        st.acts = acts;
        // The FFN runs for every row, except at the last layer where only the rows whose
        // logits are wanted matter (as llama.cpp gathers `inp_out_ids`).
        st.ffn_rows.clear();
        if layer + 1 == hp.n_layer {
            st.ffn_rows.extend_from_slice(&st.out_rows);
        } else {
            st.ffn_rows.extend(0..n as u32);
        }
        let m = st.ffn_rows.len();
        st.ffn_acts_for = None;
        st.h.resize(m * d, 0.0);
        for (i, &r) in st.ffn_rows.iter().enumerate() {
            let r = r as usize;
            rmsnorm(
                &st.x[r * d..(r + 1) * d],
                &lw.ffn_norm,
                hp.rms_eps,
                &mut st.h[i * d..(i + 1) * d],
            );
        }
        let k = hp.n_expert_used;
        st.moe.resize(m * k * d, 0.0);
        st.moe_filled.clear();
        st.moe_filled.resize(m * k, false);
        self.check(st, layer, "ffn_inp", &st.x, d, None)?;
        self.check(st, layer, "ffn_norm", &st.h, d, Some(&st.ffn_rows))
    }

    /// The router: softmax over all experts, top-k, renormalise. Rows of `out` are indices
    /// into the FFN rows of this layer (see [`RouteOut::rows`]).
    pub fn route(&self, st: &mut State, layer: usize, out: &mut RouteOut) -> Result<(), ArchError> {
        let hp = &self.w.hp;
        let lw = &self.w.layers[layer];
        let m = st.ffn_rows.len();
        let (ne, d) = (hp.n_expert, hp.d_model);
        let k = self.top_k;
        out.rows.clear();
        out.rows.extend_from_slice(&st.ffn_rows);
        out.k = k;
        out.probs.resize(m * ne, 0.0);
        let mut acts = std::mem::take(&mut st.acts);
        let h = std::mem::take(&mut st.h);
        self.matmul_rows(&lw.router, &h, m, &mut acts, &mut out.probs)?;
        st.h = h;
        st.acts = acts;
        self.check(
            st,
            layer,
            "ffn_moe_logits",
            &out.probs,
            ne,
            Some(&st.ffn_rows),
        )?;
        out.ids.resize(m * k, 0);
        out.weights.resize(m * k, 0.0);
        let mut order: Vec<u32> = (0..ne as u32).collect();
        for r in 0..m {
            select_top_k(
                &mut out.probs[r * ne..(r + 1) * ne],
                k,
                &mut order,
                &mut out.ids[r * k..(r + 1) * k],
                &mut out.weights[r * k..(r + 1) * k],
            );
        }
        // Keep the last row's router input for `predict` (a later layer's router applied to it).
        st.pred_h.clear();
        if m > 0 {
            st.pred_h.extend_from_slice(&st.h[(m - 1) * d..m * d]);
            st.pred_layer = Some(layer);
        } else {
            st.pred_layer = None;
        }
        Ok(())
    }

    /// Expert prediction: layer `target`'s router applied to the router input of layer `from`
    /// (the last row `route(from)` routed), top-`k` ids and renormalised weights written to
    /// `ids` / `weights` — the very arithmetic of `route` (same GEMV path, same selection), so
    /// `from == target` reproduces the router bit for bit. `Ok(false)` when `from` is not the
    /// layer routed last in this batch, `target` is out of range, or `k` is not in
    /// `1..=n_expert`.
    pub fn predict(
        &self,
        st: &mut State,
        from: usize,
        target: usize,
        k: usize,
        ids: &mut Vec<u32>,
        weights: &mut Vec<f32>,
    ) -> Result<bool, ArchError> {
        let hp = &self.w.hp;
        let ne = hp.n_expert;
        ids.clear();
        weights.clear();
        if st.pred_layer != Some(from) || target >= self.w.layers.len() || k == 0 || k > ne {
            return Ok(false);
        }
        let lw = &self.w.layers[target];
        st.pred_probs.resize(ne, 0.0);
        let mut probs = std::mem::take(&mut st.pred_probs);
        let mut acts = std::mem::take(&mut st.pred_acts);
        let r = self.matmul_rows(&lw.router, &st.pred_h, 1, &mut acts, &mut probs);
        st.pred_acts = acts;
        if let Err(e) = r {
            st.pred_probs = probs;
            return Err(e);
        }
        ids.resize(k, 0);
        weights.resize(k, 0.0);
        let mut order = std::mem::take(&mut st.pred_order);
        order.resize(ne, 0);
        select_top_k(&mut probs, k, &mut order, ids, weights);
        st.pred_order = order;
        st.pred_probs = probs;
        Ok(true)
    }

    /// One expert for the FFN rows routed to it. `uses` = (FFN row index, rank, weight);
    /// `proj` = the expert's gate, up and down bytes, wherever they live (map or arena).
    pub fn expert(
        &self,
        st: &mut State,
        layer: usize,
        proj: [&[u8]; 3],
        uses: &[(u32, u16, f32)],
    ) -> Result<(), ArchError> {
        let hp = &self.w.hp;
        let lw = &self.w.layers[layer];
        let (d, ff, k) = (hp.d_model, hp.n_ff_exp, hp.n_expert_used);
        let n = uses.len();
        if n == 0 {
            return Ok(());
        }
        let [g, u, dn] = &lw.exps;
        for (p, x) in proj.iter().zip(&lw.exps) {
            if p.len() as u64 != x.stride {
                return Err(ArchError::Tensor {
                    file: String::new(),
                    tensor: x.info.name.clone(),
                    what: format!("expert slice of {} bytes, expected {}", p.len(), x.stride),
                });
            }
        }
        st.gate.resize(n * ff, 0.0);
        st.up.resize(n * ff, 0.0);
        st.down.resize(n * d, 0.0);
        // Every FFN row's input quantised once per layer (rows are routed to k experts each),
        // in parallel; each expert takes its rows' activations by reference. The bits are the
        // same as quantising an expert's rows itself.
        let m = st.ffn_rows.len();
        let g_act = ActFormat::for_weights(g.info.ty);
        if st.ffn_acts_for != g_act.map(|f| (layer, f)) {
            st.ffn_acts_for = None;
            prepare_acts(&self.pool, g.info.ty, &st.h, m, d, &mut st.ffn_acts)?;
            st.ffn_acts_for = g_act.map(|f| (layer, f));
        }
        let mut act2 = std::mem::take(&mut st.act2);
        let mut picked: Vec<&ActBuf> = Vec::with_capacity(n);
        for &(row, _, _) in uses {
            match st.ffn_acts.get(row as usize) {
                Some(a) if (row as usize) < m => picked.push(a),
                _ => {
                    return Err(ArchError::Tensor {
                        file: String::new(),
                        tensor: g.info.name.clone(),
                        what: format!("expert use of FFN row {row}, but the layer has {m}"),
                    })
                }
            }
        }
        mul_prepared(&self.pool, g.info.ty, proj[0], ff, d, &picked, &mut st.gate)?;
        if ActFormat::for_weights(u.info.ty) == g_act {
            mul_prepared(&self.pool, u.info.ty, proj[1], ff, d, &picked, &mut st.up)?;
        } else {
            // An up projection whose activation format differs from the gate's (a mixed
            // file): its rows quantised here, for this expert.
            st.tmp.resize(n * d, 0.0);
            for (i, &(row, _, _)) in uses.iter().enumerate() {
                let r = row as usize;
                st.tmp[i * d..(i + 1) * d].copy_from_slice(&st.h[r * d..(r + 1) * d]);
            }
            let mut acts = std::mem::take(&mut st.acts);
            let r = prepare_acts(&self.pool, u.info.ty, &st.tmp, n, d, &mut acts).and_then(|_| {
                mul_prepared(
                    &self.pool,
                    u.info.ty,
                    proj[1],
                    ff,
                    d,
                    &acts[..n],
                    &mut st.up,
                )
            });
            st.acts = acts;
            r?;
        }
        drop(picked);
        for (a, &b) in st.gate.iter_mut().zip(&st.up) {
            *a = silu(*a) * b;
        }
        prepare_acts(&self.pool, dn.info.ty, &st.gate, n, ff, &mut act2)?;
        mul_prepared(
            &self.pool,
            dn.info.ty,
            proj[2],
            d,
            ff,
            &act2[..n],
            &mut st.down,
        )?;
        st.act2 = act2;
        for (i, &(row, rank, w)) in uses.iter().enumerate() {
            let slot = row as usize * k + rank as usize;
            let dst = &mut st.moe[slot * d..(slot + 1) * d];
            for (o, &y) in dst.iter_mut().zip(&st.down[i * d..(i + 1) * d]) {
                *o = y * w;
            }
            st.moe_filled[slot] = true;
        }
        Ok(())
    }

    /// Sum the weighted expert outputs in rank order into the residual stream.
    pub fn finish_layer(&self, st: &mut State, layer: usize) -> Result<(), ArchError> {
        let hp = &self.w.hp;
        let (d, k) = (hp.d_model, hp.n_expert_used);
        for (i, &row) in st.ffn_rows.iter().enumerate() {
            let base = i * k;
            // Ranks never computed (dropped by a policy) contribute nothing.
            let mut acc: Option<usize> = None;
            for j in 0..k {
                if !st.moe_filled[base + j] {
                    continue;
                }
                match acc {
                    None => acc = Some(base + j),
                    Some(a) => {
                        let (lo, hi) = st.moe.split_at_mut((base + j) * d);
                        for (x, &y) in lo[a * d..(a + 1) * d].iter_mut().zip(&hi[..d]) {
                            *x += y;
                        }
                    }
                }
            }
            if let Some(a) = acc {
                let r = row as usize;
                for (x, &y) in st.x[r * d..(r + 1) * d]
                    .iter_mut()
                    .zip(&st.moe[a * d..(a + 1) * d])
                {
                    *x += y;
                }
            }
        }
        // After the last layer only the output rows remain meaningful.
        for &row in &st.ffn_rows {
            let r = row as usize;
            self.check(
                st,
                layer,
                "l_out",
                &st.x[r * d..(r + 1) * d],
                d,
                Some(&[row]),
            )?;
        }
        Ok(())
    }

    /// Final norm and output head for the output rows; logits land in `st.logits`
    /// (`out_rows.len() × n_vocab`).
    pub fn head(&self, st: &mut State) -> Result<(), ArchError> {
        let hp = &self.w.hp;
        let d = hp.d_model;
        let m = st.out_rows.len();
        st.h.resize(m * d, 0.0);
        for (i, &r) in st.out_rows.iter().enumerate() {
            let r = r as usize;
            rmsnorm(
                &st.x[r * d..(r + 1) * d],
                &self.w.output_norm,
                hp.rms_eps,
                &mut st.h[i * d..(i + 1) * d],
            );
        }
        st.logits.resize(m * hp.n_vocab, 0.0);
        let mut acts = std::mem::take(&mut st.acts);
        let h = std::mem::take(&mut st.h);
        let mut logits = std::mem::take(&mut st.logits);
        self.matmul_rows(&self.w.output, &h, m, &mut acts, &mut logits)?;
        st.logits = logits;
        st.h = h;
        st.acts = acts;
        Ok(())
    }
}
