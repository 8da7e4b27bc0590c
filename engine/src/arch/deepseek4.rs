//! DeepSeek V4 (`general.architecture = deepseek4`), as llama.cpp's `src/models/deepseek4.cpp`
//! computes it; docs/architectures.md ("deepseek4") maps every part.
//!
//! - **Hyper-connections**: the residual is `hc` = 4 streams of `d_model` ([`State::streams`]).
//!   Before each sub-layer (attention, FFN) a 24-wide mix of the RMS-normed streams gives the
//!   input's weights over the streams (`pre`), the output's over them (`post`) and a
//!   Sinkhorn-normalised 4×4 stream mix (`comb`); after it every stream becomes
//!   `post · f + Σ comb · streams`. The head collapses the streams the same way (`pre` only).
//! - **Attention**: a query LoRA, every head RMS-normed without weight; one key head whose
//!   key is its value (`attn_kv`, normed); rope (adjacent pairs) on each head's last
//!   `rope.dimension_count` values, undone on the output; per-head sinks; a sliding window of
//!   raw keys, and on compressed layers (`attention.compress_ratios`) the compressed rows
//!   of every finished block: all of them (ratio 128) or the indexer's top-k (ratio 4).
//!   The output goes through `G` grouped low-rank projections and one `attn_output_b`.
//! - **Compressors**: per channel, a softmax over the block's positions (ratio 4: also the
//!   previous block's, from the other half of the channels) of the gate scores plus a position
//!   embedding weighs the positions' kv rows; the sum is RMS-normed and roped at the block's
//!   first position (the compressed rope base, with YaRN).
//! - **Routing**: `√softplus(logits)` scores, selection with `exp_probs_b`; the first
//!   `hash_layer_count` layers route each token to the experts `ffn_gate_tid2eid` lists for
//!   it ([`Arch::fixed_experts`]). Experts and the shared expert use ggml's `swiglu_clamp`.
//!
//! **Memory** ([`LayerMemory::Compressed`]): a ring of one row per position — its raw key
//! and, on a compressed layer, its compressor inputs (kv and scores) — holding the window and
//! the block being filled (plus a ring's slack for rollback), and one row per finished block:
//! its compressed row (and the indexer's), computed once when the batch holding the block's
//! last position runs.
//!
//! Not run: the MTP block (`nextn_predict_layers`; its layers are not loaded), image inputs.

use super::blocks::{self, sigmoid, Compute, Glu, Rope, RopeKind};
use super::layers::{norm_head, GluFfn};
use super::meta::{self, moe_params, n_vocab, yarn_params, Meta};
use super::state::{KvSource, LayerMemory, State};
use super::weights::{Loader, Mat};
use super::{Arch, ArchError, Common, CommonLayer, Dims, Experts};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use bmoe_core::gating::softmax_in_place;
use bmoe_core::{Gating, GatingFunc};
use std::sync::Arc;

pub const ARCH: &str = "deepseek4";

/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS`.
const GATING_FUNC_SQRT_SOFTPLUS: usize = 4;
/// The streams llama.cpp's graph runs (it asserts 4).
const HC: usize = 4;
/// The mixes per sub-layer: `pre` and `post` (one per stream) and the 4×4 `comb`.
const MIX: usize = (2 + HC) * HC;

/// Hyper-parameters, read and checked once at load.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    /// Layers the forward pass runs (`block_count` less the MTP blocks).
    pub n_layer: usize,
    pub d_model: usize,
    pub n_head: usize,
    /// `attention.key_length` (= `value_length`): a head, its key and its value.
    pub head_dim: usize,
    /// Rotated values at the end of each head.
    pub n_rot: usize,
    pub q_lora_rank: usize,
    /// `attention.sliding_window`: the raw keys a query sees, itself included.
    pub n_swa: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_ff_exp: usize,
    pub n_shared: usize,
    pub gating: Gating,
    /// Per layer, the routed and the shared experts' SwiGLU limits (0: none).
    pub clamp_exp: Vec<f32>,
    pub clamp_shexp: Vec<f32>,
    pub idx_heads: usize,
    pub idx_dim: usize,
    pub idx_top_k: usize,
    /// `attention.output_group_count`, `attention.output_lora_rank`.
    pub o_groups: usize,
    pub o_rank: usize,
    /// Per layer: 0 (window only), 4 (indexed compressed rows) or 128 (all compressed rows).
    pub ratios: Vec<usize>,
    pub hash_layers: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub rope_base: f32,
    pub compress_rope_base: f32,
    pub yarn: Option<blocks::Yarn>,
    pub rms_eps: f32,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<HParams, ArchError> {
        let m = Meta::new(f, ARCH);
        let blocks_n = m.req_u("block_count")?;
        let nextn = m.opt_u("nextn_predict_layers")?.unwrap_or(0);
        if nextn >= blocks_n {
            return Err(m.err(
                "nextn_predict_layers",
                format!("is {nextn}: no layer left of block_count {blocks_n}"),
            ));
        }
        let n_layer = blocks_n - nextn;
        let d_model = m.req_u("embedding_length")?;
        m.check_range("embedding_length", d_model, 1, 1 << 16)?;
        let n_head = m.req_u("attention.head_count")?;
        m.check_range("attention.head_count", n_head, 1, 1024)?;
        if let Some(kv) = m.opt_u("attention.head_count_kv")? {
            if kv != 1 {
                return Err(m.err(
                    "attention.head_count_kv",
                    format!("is {kv}: deepseek4 attends over one key head"),
                ));
            }
        }
        let head_dim = m.req_u("attention.key_length")?;
        let v = m.opt_u("attention.value_length")?.unwrap_or(head_dim);
        if v != head_dim || head_dim == 0 {
            return Err(m.err(
                "attention.value_length",
                format!("is {v}: expected key_length {head_dim} (a key is its value)"),
            ));
        }
        let n_rot = m.req_u("rope.dimension_count")?;
        if n_rot == 0 || n_rot % 2 != 0 || n_rot > head_dim {
            return Err(m.err(
                "rope.dimension_count",
                format!("is {n_rot}: expected an even count up to key_length {head_dim}"),
            ));
        }
        let q_lora_rank = m.req_u("attention.q_lora_rank")?;
        m.check_range("attention.q_lora_rank", q_lora_rank, 1, 1 << 16)?;
        let n_swa = m.req_u("attention.sliding_window")?;
        m.check_range("attention.sliding_window", n_swa, 1, 1 << 24)?;
        let (n_expert, n_expert_used, n_ff_exp) = moe_params(&m)?;
        let n_shared = m.req_u("expert_shared_count")?;
        m.check_range("expert_shared_count", n_shared, 1, 64)?;
        let func = m.req_u("expert_gating_func")?;
        if func != GATING_FUNC_SQRT_SOFTPLUS {
            return Err(m.err(
                "expert_gating_func",
                format!(
                    "is {func}: deepseek4 scores with sqrt-softplus (4), as llama.cpp requires"
                ),
            ));
        }
        if let Some(g) = m.opt_u("expert_group_count")?.filter(|&g| g > 1) {
            return Err(m.err(
                "expert_group_count",
                format!("is {g}: grouped selection is not run for deepseek4 (llama.cpp's graph does not set it either)"),
            ));
        }
        let gating = Gating {
            func: GatingFunc::SqrtSoftplus,
            renormalize: m.opt_bool("expert_weights_norm")?.unwrap_or(false),
            scale: m.opt_f("expert_weights_scale", 0.0)?,
            groups: 0,
            groups_used: 0,
        };
        let clamp_exp = meta::swiglu_limits(&m, "swiglu_clamp_exp", n_layer)?;
        let clamp_shexp = if m.get("swiglu_clamp_shexp").is_some() {
            meta::swiglu_limits(&m, "swiglu_clamp_shexp", n_layer)?
        } else {
            clamp_exp.clone()
        };
        let idx_heads = m.req_u("attention.indexer.head_count")?;
        m.check_range("attention.indexer.head_count", idx_heads, 1, 1024)?;
        let idx_dim = m.req_u("attention.indexer.key_length")?;
        if idx_dim < n_rot {
            return Err(m.err(
                "attention.indexer.key_length",
                format!("is {idx_dim}: under rope.dimension_count {n_rot}, which it rotates"),
            ));
        }
        let idx_top_k = m.req_u("attention.indexer.top_k")?;
        m.check_range("attention.indexer.top_k", idx_top_k, 1, 1 << 20)?;
        let o_groups = m.req_u("attention.output_group_count")?;
        if o_groups == 0 || n_head % o_groups != 0 {
            return Err(m.err(
                "attention.output_group_count",
                format!("is {o_groups}: expected a divisor of head_count {n_head}"),
            ));
        }
        let o_rank = m.req_u("attention.output_lora_rank")?;
        m.check_range("attention.output_lora_rank", o_rank, 1, 1 << 16)?;
        let ratios = compress_ratios(&m, blocks_n)?[..n_layer].to_vec();
        let hc = m.req_u("hyper_connection.count")?;
        if hc != HC {
            return Err(m.err(
                "hyper_connection.count",
                format!("is {hc}: llama.cpp's graph (and this build) runs {HC} streams"),
            ));
        }
        let sinkhorn_iters = m.req_u("hyper_connection.sinkhorn_iterations")?;
        m.check_range(
            "hyper_connection.sinkhorn_iterations",
            sinkhorn_iters,
            1,
            1000,
        )?;
        let hc_eps = m.req_f("hyper_connection.epsilon")?;
        let hash_layers = m.opt_u("hash_layer_count")?.unwrap_or(0);
        if hash_layers > n_layer {
            return Err(m.err(
                "hash_layer_count",
                format!("is {hash_layers}: more than the {n_layer} layers"),
            ));
        }
        let n_ctx_train = m.req_u("context_length")?;
        Ok(HParams {
            n_layer,
            d_model,
            n_head,
            head_dim,
            n_rot,
            q_lora_rank,
            n_swa,
            n_expert,
            n_expert_used,
            n_ff_exp,
            n_shared,
            gating,
            clamp_exp,
            clamp_shexp,
            idx_heads,
            idx_dim,
            idx_top_k,
            o_groups,
            o_rank,
            ratios,
            hash_layers,
            sinkhorn_iters,
            hc_eps,
            rope_base: m.opt_f("rope.freq_base", 10_000.0)?,
            compress_rope_base: m.req_f("attention.compress_rope_freq_base")?,
            yarn: yarn_params(&m, n_ctx_train)?,
            rms_eps: m.req_f("attention.layer_norm_rms_epsilon")?,
            n_vocab: n_vocab(f)?,
            n_ctx_train,
        })
    }

    /// The compressor's channels on a layer of `ratio` (ratio 4 reads two halves).
    fn comp_width(&self, ratio: usize) -> usize {
        match ratio {
            4 => 2 * self.head_dim,
            128 => self.head_dim,
            _ => 0,
        }
    }

    /// Where a memory row and a block row keep what: see [`RowLayout`].
    fn layout(&self, ratio: usize) -> RowLayout {
        let d = self.head_dim;
        let cw = self.comp_width(ratio);
        let iw = if ratio == 4 { 2 * self.idx_dim } else { 0 };
        RowLayout {
            kv: 0,
            comp_kv: d,
            comp_score: d + cw,
            idx_kv: d + 2 * cw,
            idx_score: d + 2 * cw + iw,
            width: d + 2 * cw + 2 * iw,
            comp_row: 0,
            idx_row: d,
            block_width: match ratio {
                0 => 0,
                4 => d + self.idx_dim,
                _ => d,
            },
        }
    }

    /// The layer's memory: the ring holds the window and, on a compressed layer, the block
    /// being filled (and for ratio 4 the one before it, which the overlap reads).
    fn memory(&self, ratio: usize) -> LayerMemory {
        let lay = self.layout(ratio);
        let need = match ratio {
            4 => 8,
            r => r,
        };
        LayerMemory::Compressed {
            width: lay.width,
            window: self.n_swa.max(need),
            ratio,
            block_width: lay.block_width,
        }
    }
}

/// `attention.compress_ratios`: one of 0, 4, 128 per block (at least `blocks` entries).
fn compress_ratios(m: &Meta, blocks: usize) -> Result<Vec<usize>, ArchError> {
    let key = "attention.compress_ratios";
    let v = m
        .get(key)
        .ok_or_else(|| m.err(key, "is missing (required for deepseek4)"))?;
    let arr = v
        .as_array()
        .ok_or_else(|| m.err(key, format!("is {v}, expected an array per block")))?;
    let r: Vec<usize> = arr
        .iter()
        .map(|x| x.as_u64().map(|x| x as usize))
        .collect::<Option<_>>()
        .ok_or_else(|| m.err(key, "holds a value that is not a count"))?;
    if r.len() < blocks {
        return Err(m.err(
            key,
            format!("has {} entries, fewer than block_count {blocks}", r.len()),
        ));
    }
    if let Some(bad) = r.iter().find(|&&x| !matches!(x, 0 | 4 | 128)) {
        return Err(m.err(
            key,
            format!("holds {bad}: llama.cpp (and this build) run ratios 0, 4 and 128"),
        ));
    }
    Ok(r)
}

/// Offsets in a layer's ring row (one per position): the raw key (`kv`, `head_dim`); on a
/// compressed layer the compressor's kv and scores of the position; on a ratio-4 layer the
/// indexer's compressor's too. And in a block row (one per finished block): the block's
/// compressed row (`comp_row`, `head_dim`), and on ratio 4 the indexer's (`idx_row`).
#[derive(Copy, Clone, Debug)]
struct RowLayout {
    kv: usize,
    comp_kv: usize,
    comp_score: usize,
    idx_kv: usize,
    idx_score: usize,
    width: usize,
    comp_row: usize,
    idx_row: usize,
    block_width: usize,
}

/// One sub-layer's hyper-connection weights (`hc_attn_*`, `hc_ffn_*`, or the head's).
struct HcWeights {
    /// `fn`: `hc·d_model` → the mixes.
    mix: Mat,
    base: Vec<f32>,
    scale: Vec<f32>,
}

/// A KV compressor (`attn_compressor_*` or `indexer_compressor_*`).
struct Compressor {
    kv: Mat,
    gate: Mat,
    /// `ape`: per position in the block, one score offset per channel.
    ape: Vec<f32>,
    norm: Vec<f32>,
}

struct Indexer {
    q_b: Mat,
    proj: Mat,
    comp: Compressor,
}

struct LayerWeights {
    hc_attn: HcWeights,
    hc_ffn: HcWeights,
    attn_norm: Vec<f32>,
    sinks: Vec<f32>,
    q_a: Mat,
    q_a_norm: Vec<f32>,
    q_b: Mat,
    kv: Mat,
    kv_norm: Vec<f32>,
    out_a: Mat,
    out_b: Mat,
    comp: Option<Compressor>,
    indexer: Option<Indexer>,
    ffn_norm: Vec<f32>,
    shared: GluFfn,
    probs_bias: Option<Vec<f32>>,
    /// A hash layer's experts per token (`n_expert_used` each).
    hash: Option<Vec<u32>>,
}

/// A loaded deepseek4 model.
pub struct Deepseek4 {
    pub hp: HParams,
    common: Common,
    layers: Vec<LayerWeights>,
    head_hc: HcWeights,
    /// Rope of the window-only layers, and of the compressed layers, their rows and the
    /// indexer (the compressed base, with the file's YaRN).
    rope_plain: Rope,
    rope_comp: Rope,
}

/// Load `file` as deepseek4 (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(Deepseek4::load(file, mode)?))
}

/// A small matrix of any weight type read to f32, row after row (`ape`).
fn mat_floats(
    ld: &mut Loader,
    name: &str,
    cols: usize,
    rows: usize,
) -> Result<Vec<f32>, ArchError> {
    let m = ld.mat(name, cols, rows)?;
    let mut out = vec![0f32; cols * rows];
    for (r, row) in out.chunks_exact_mut(cols).enumerate() {
        m.row_f32(r, row)?;
    }
    Ok(out)
}

fn hc_weights(
    ld: &mut Loader,
    prefix: &str,
    d: usize,
    mixes: usize,
) -> Result<HcWeights, ArchError> {
    let scale_n = if mixes == HC { 1 } else { 3 };
    Ok(HcWeights {
        mix: ld.mat(&format!("{prefix}_fn.weight"), HC * d, mixes)?,
        base: ld.vector(&format!("{prefix}_base.weight"), mixes)?,
        scale: ld.vector(&format!("{prefix}_scale.weight"), scale_n)?,
    })
}

fn compressor(
    ld: &mut Loader,
    prefix: &str,
    d: usize,
    width: usize,
    norm: usize,
    ratio: usize,
) -> Result<Compressor, ArchError> {
    Ok(Compressor {
        kv: ld.mat(&format!("{prefix}_kv.weight"), d, width)?,
        gate: ld.mat(&format!("{prefix}_gate.weight"), d, width)?,
        ape: mat_floats(ld, &format!("{prefix}_ape.weight"), width, ratio)?,
        norm: ld.vector(&format!("{prefix}_norm.weight"), norm)?,
    })
}

/// The GLU of a `swiglu_clamp` limit: limited only above 1e-6, as llama.cpp.
fn glu_for(limit: f32) -> Glu {
    if limit > 1e-6 {
        Glu::SiluOfClamped { limit }
    } else {
        Glu::Silu
    }
}

/// What one row's attention reads (see [`RowAttn::row`]).
struct RowAttn<'a> {
    hp: &'a HParams,
    lay: RowLayout,
    ratio: usize,
    /// The ring (and the batch's own rows) by position, and the finished blocks' rows.
    src: &'a KvSource<'a>,
    blocks: &'a [f32],
    q: &'a [f32],
    qi: &'a [f32],
    iwt: &'a [f32],
    sinks: &'a [f32],
}

impl RowAttn<'_> {
    /// Batch row `t` at position `p`: every head over the window's raw keys, then the
    /// compressed rows the layer's ratio shows it (all finished blocks at 128; at 4 the
    /// indexer's top-k of them, ties to the lower block), one softmax with the head's sink;
    /// the heads' outputs (`n_head × head_dim`, still roped) into `out`.
    fn row(&self, t: usize, p: usize, out: &mut [f32]) {
        let (hp, lay) = (self.hp, self.lay);
        let (hd, nh, ratio) = (hp.head_dim, hp.n_head, self.ratio);
        let bw = lay.block_width;
        // A key: the raw row of a position, or a block's compressed row.
        let raw = |k: usize| &self.src.key(k)[lay.kv..lay.kv + hd];
        let block = |b: usize| &self.blocks[b * bw + lay.comp_row..b * bw + lay.comp_row + hd];
        let mut keys: Vec<&[f32]> = ((p + 1).saturating_sub(hp.n_swa)..=p).map(raw).collect();
        if let Some(blocks_seen) = (p + 1).checked_div(ratio) {
            if ratio == 128 {
                keys.extend((0..blocks_seen).map(block));
            } else if blocks_seen > 0 {
                // The indexer: Σ_h w_h · ReLU(q_h · k_b) per finished block, its top-k.
                let (idim, ih) = (hp.idx_dim, hp.idx_heads);
                let wscale = 1.0 / ((idim * ih) as f32).sqrt();
                let mut picked: Vec<(f32, usize)> = (0..blocks_seen)
                    .map(|b| {
                        let kb = &self.blocks[b * bw + lay.idx_row..b * bw + lay.idx_row + idim];
                        let mut s = 0f32;
                        for h in 0..ih {
                            let qh = &self.qi[(t * ih + h) * idim..(t * ih + h + 1) * idim];
                            let dot: f32 = qh.iter().zip(kb).map(|(a, b)| a * b).sum();
                            s += dot.max(0.0) * (self.iwt[t * ih + h] * wscale);
                        }
                        (s, b)
                    })
                    .collect();
                picked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                picked.truncate(hp.idx_top_k);
                keys.extend(picked.iter().map(|&(_, b)| block(b)));
            }
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut scores = Vec::with_capacity(keys.len());
        out.fill(0.0);
        for h in 0..nh {
            let qh = &self.q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
            scores.clear();
            for &kr in &keys {
                let dot: f32 = qh.iter().zip(kr).map(|(a, b)| a * b).sum();
                scores.push(dot * scale);
            }
            let sink = self.sinks[h];
            let mx = scores.iter().copied().fold(sink, f32::max);
            let mut sum = (sink - mx).exp() as f64;
            for s in scores.iter_mut() {
                *s = (*s - mx).exp();
                sum += *s as f64;
            }
            let inv = (1.0 / sum) as f32;
            let o = &mut out[h * hd..(h + 1) * hd];
            for (kr, &s) in keys.iter().zip(scores.iter()) {
                for (a, &v) in o.iter_mut().zip(kr.iter()) {
                    *a += s * inv * v;
                }
            }
        }
    }
}

impl Deepseek4 {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Deepseek4, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let (d, hd, nh) = (hp.d_model, hp.head_dim, hp.n_head);
        let (embd, output, output_norm) =
            ld.embedding_and_head(d, hp.n_vocab, "output_norm.weight")?;
        let head_hc = hc_weights(&mut ld, "output_hc", d, HC)?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        let mut common_layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let ratio = hp.ratios[i];
            let cw = hp.comp_width(ratio);
            let comp = if ratio != 0 {
                Some(compressor(
                    &mut ld,
                    &format!("blk.{i}.attn_compressor"),
                    d,
                    cw,
                    hd,
                    ratio,
                )?)
            } else {
                None
            };
            let indexer = if ratio == 4 {
                Some(Indexer {
                    q_b: ld.mat(
                        &n("indexer.attn_q_b"),
                        hp.q_lora_rank,
                        hp.idx_heads * hp.idx_dim,
                    )?,
                    proj: ld.mat(&n("indexer.proj"), d, hp.idx_heads)?,
                    comp: compressor(
                        &mut ld,
                        &format!("blk.{i}.indexer_compressor"),
                        d,
                        2 * hp.idx_dim,
                        hp.idx_dim,
                        4,
                    )?,
                })
            } else {
                None
            };
            let (probs_bias, hash) = if i < hp.hash_layers {
                let k = hp.n_expert_used;
                let raw = ld.ids(&n("ffn_gate_tid2eid"), &[k, hp.n_vocab])?;
                let mut ids = Vec::with_capacity(raw.len());
                for (j, &e) in raw.iter().enumerate() {
                    if e < 0 || e as usize >= hp.n_expert {
                        return Err(ArchError::Tensor {
                            file: ld.path(),
                            tensor: n("ffn_gate_tid2eid"),
                            what: format!(
                                "routes token {} to expert {e}, outside 0..{}",
                                j / k,
                                hp.n_expert
                            ),
                        });
                    }
                    ids.push(e as u32);
                }
                (None, Some(ids))
            } else {
                let b = ld.vector(&format!("blk.{i}.exp_probs_b.bias"), hp.n_expert)?;
                (Some(b), None)
            };
            let mut shared = GluFfn::load(&mut ld, i, "_shexp", d, hp.n_ff_exp * hp.n_shared)?;
            shared.glu = glu_for(hp.clamp_shexp[i]);
            let moe = Experts {
                router: ld.mat(&n("ffn_gate_inp"), d, hp.n_expert)?,
                router_bias: None,
                exps: ld.glu_experts(i, d, hp.n_ff_exp, hp.n_expert)?,
            };
            layers.push(LayerWeights {
                hc_attn: hc_weights(&mut ld, &format!("blk.{i}.hc_attn"), d, MIX)?,
                hc_ffn: hc_weights(&mut ld, &format!("blk.{i}.hc_ffn"), d, MIX)?,
                attn_norm: ld.vector(&n("attn_norm"), d)?,
                sinks: ld.vector(&n("attn_sinks"), nh)?,
                q_a: ld.mat(&n("attn_q_a"), d, hp.q_lora_rank)?,
                q_a_norm: ld.vector(&n("attn_q_a_norm"), hp.q_lora_rank)?,
                q_b: ld.mat(&n("attn_q_b"), hp.q_lora_rank, nh * hd)?,
                kv: ld.mat(&n("attn_kv"), d, hd)?,
                kv_norm: ld.vector(&n("attn_kv_a_norm"), hd)?,
                out_a: ld.mat(
                    &n("attn_output_a"),
                    nh * hd / hp.o_groups,
                    hp.o_rank * hp.o_groups,
                )?,
                out_b: ld.mat(&n("attn_output_b"), hp.o_groups * hp.o_rank, d)?,
                comp,
                indexer,
                ffn_norm: ld.vector(&n("ffn_norm"), d)?,
                shared,
                probs_bias,
                hash,
            });
            common_layers.push(CommonLayer {
                memory: hp.memory(ratio),
                moe: Some(moe),
            });
        }
        let rope_plain = Rope::plain(RopeKind::Normal, hp.n_rot, hp.rope_base);
        let mut rope_comp = match hp.yarn {
            Some(y) => Rope::yarn(RopeKind::Normal, hp.n_rot, hp.compress_rope_base, y),
            None => Rope::plain(RopeKind::Normal, hp.n_rot, hp.compress_rope_base),
        };
        // llama.cpp's `dsv4_rope_attn_factor`: cancels YaRN's magnitude factor exactly as the
        // kernel applies it (the net scale is 1, not the file's attn_factor).
        rope_comp.attn_factor = if rope_comp.ext_factor != 0.0 {
            1.0 / (1.0 + 0.1 * (1.0 / rope_comp.freq_scale).ln())
        } else {
            1.0
        };
        Ok(Deepseek4 {
            common: Common {
                name: ARCH,
                dims: Dims {
                    n_layer: hp.n_layer,
                    n_expert: hp.n_expert,
                    n_expert_used: hp.n_expert_used,
                    d_model: d,
                    n_vocab: hp.n_vocab,
                    n_ctx_train: hp.n_ctx_train,
                },
                gating: hp.gating,
                embd,
                output,
                output_norm,
                rms_eps: hp.rms_eps,
                n_ff_exp: hp.n_ff_exp,
                glu: Glu::Silu,
                layers: common_layers,
                weights: ld.finish(),
            },
            head_hc,
            rope_plain,
            rope_comp,
            hp,
            layers,
        })
    }

    /// The mixes of `rows` rows of streams (`rows × hc·d`) through `w.mix`, after an RMS norm
    /// of each whole row (no weight), into `mixes` (`rows × w.base.len()`).
    fn mixes(
        &self,
        cx: &Compute,
        st: &mut State,
        w: &HcWeights,
        flat: &[f32],
        rows: usize,
        mixes: &mut Vec<f32>,
    ) -> Result<(), ArchError> {
        let wide = HC * self.hp.d_model;
        let State { scratch, .. } = st;
        let normed = &mut scratch.tmp;
        normed.resize(rows * wide, 0.0);
        for (src, dst) in flat
            .chunks_exact(wide)
            .zip(normed.chunks_exact_mut(wide))
            .take(rows)
        {
            blocks::rms_norm(src, None, self.hp.rms_eps, dst);
        }
        mixes.resize(rows * w.base.len(), 0.0);
        cx.mat_rows(&w.mix, &scratch.tmp, rows, &mut scratch.acts, mixes)
    }

    /// One row's `pre` weights, `post` weights and Sinkhorn-normalised `comb[dst + hc·src]`
    /// from its 24 mixes (`hc_pre` of llama.cpp, unfused).
    fn pre_post_comb(&self, w: &HcWeights, m: &[f32]) -> ([f32; HC], [f32; HC], [f32; HC * HC]) {
        let eps = self.hp.hc_eps;
        let mut pre = [0f32; HC];
        let mut post = [0f32; HC];
        for s in 0..HC {
            pre[s] = sigmoid(m[s] * w.scale[0] + w.base[s]) + eps;
            post[s] = 2.0 * sigmoid(m[HC + s] * w.scale[1] + w.base[HC + s]);
        }
        let mut c = [0f32; HC * HC];
        for (i, v) in c.iter_mut().enumerate() {
            *v = m[2 * HC + i] * w.scale[2] + w.base[2 * HC + i];
        }
        // Softmax over dst for each src, + ε.
        for src in 0..HC {
            softmax_in_place(&mut c[src * HC..(src + 1) * HC]);
        }
        c.iter_mut().for_each(|v| *v += eps);
        let norm_cols = |c: &mut [f32; HC * HC]| {
            for dst in 0..HC {
                let sum: f32 = (0..HC).map(|src| c[dst + HC * src]).sum::<f32>() + eps;
                for src in 0..HC {
                    c[dst + HC * src] /= sum;
                }
            }
        };
        let norm_rows = |c: &mut [f32; HC * HC]| {
            for src in 0..HC {
                let sum: f32 = c[src * HC..(src + 1) * HC].iter().sum::<f32>() + eps;
                c[src * HC..(src + 1) * HC]
                    .iter_mut()
                    .for_each(|v| *v /= sum);
            }
        };
        norm_cols(&mut c);
        for _ in 1..self.hp.sinkhorn_iters {
            norm_rows(&mut c);
            norm_cols(&mut c);
        }
        (pre, post, c)
    }

    /// The sub-layer input of `streams` (one row): `Σ pre_s · X_s`.
    fn collapse(&self, streams: &[f32], pre: &[f32; HC], out: &mut [f32]) {
        let d = self.hp.d_model;
        out.fill(0.0);
        for s in 0..HC {
            for (o, &x) in out.iter_mut().zip(&streams[s * d..(s + 1) * d]) {
                *o += x * pre[s];
            }
        }
    }

    /// The streams after a sub-layer of output `f`: `X'_dst = post_dst·f + Σ_src comb·X_src`.
    fn expand(&self, streams: &mut [f32], f: &[f32], post: &[f32], comb: &[f32]) {
        let d = self.hp.d_model;
        for (e, &fe) in f.iter().enumerate().take(d) {
            // The element's old value in every stream, then its new one in each.
            let old: [f32; HC] = std::array::from_fn(|s| streams[s * d + e]);
            for dst in 0..HC {
                let mut v = fe * post[dst];
                for (src, &x) in old.iter().enumerate() {
                    v += x * comb[dst + HC * src];
                }
                streams[dst * d + e] = v;
            }
        }
    }

    /// The streams of `rows` (batch row indices), one `hc·d` row each.
    fn gather(&self, streams: &[f32], rows: &[u32]) -> Vec<f32> {
        let wide = HC * self.hp.d_model;
        rows.iter()
            .flat_map(|&r| &streams[r as usize * wide..(r as usize + 1) * wide])
            .copied()
            .collect()
    }

    /// The compressed row of the block ending at batch position `p` (the rows of positions
    /// read through `src`, layout offsets `kv`/`score`, `half` = the row's width): a softmax
    /// per channel over the block's positions (ratio 4: and the previous block's, read from
    /// the first half of the channels, the block's own from the second), RMS-normed and roped
    /// at the block's first position.
    #[allow(clippy::too_many_arguments)]
    fn compress(
        &self,
        src: &KvSource<'_>,
        p: usize,
        ratio: usize,
        (kv, score): (usize, usize),
        half: usize,
        norm: &[f32],
        out: &mut Vec<f32>,
    ) {
        let start = p + 1 - ratio;
        let overlap = ratio == 4;
        out.clear();
        out.resize(half, 0.0);
        let mut w = Vec::with_capacity(2 * ratio);
        let mut vals = Vec::with_capacity(2 * ratio);
        for (c, o) in out.iter_mut().enumerate() {
            w.clear();
            vals.clear();
            if overlap && start >= ratio {
                for q in start - ratio..start {
                    let row = src.key(q);
                    w.push(row[score + c]);
                    vals.push(row[kv + c]);
                }
            }
            let off = if overlap { half } else { 0 };
            for q in start..=p {
                let row = src.key(q);
                w.push(row[score + off + c]);
                vals.push(row[kv + off + c]);
            }
            softmax_in_place(&mut w);
            *o = w.iter().zip(&vals).map(|(a, b)| a * b).sum();
        }
        let raw = out.clone();
        blocks::rms_norm(&raw, Some(norm), self.hp.rms_eps, out);
        let mut cache = Vec::new();
        self.rope_comp.cache(start as u32, &mut cache);
        let n = out.len();
        self.rope_comp.apply(&cache, &mut out[n - self.hp.n_rot..]);
    }

    /// Layer `il`'s attention on `st.cur` (every batch row, normed) into `st.out`.
    fn attention(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let hp = &self.hp;
        let l = &self.layers[il];
        let n = st.n_rows;
        let (d, hd, nh, r) = (hp.d_model, hp.head_dim, hp.n_head, hp.n_rot);
        let ratio = hp.ratios[il];
        let lay = hp.layout(ratio);
        let cw = hp.comp_width(ratio);
        let iw = 2 * hp.idx_dim;
        let rope = if ratio == 0 {
            &self.rope_plain
        } else {
            &self.rope_comp
        };
        // Projections of the normed input.
        let mut qa = vec![0f32; n * hp.q_lora_rank];
        let mut kv = vec![0f32; n * hd];
        let mut ckv = vec![0f32; n * cw];
        let mut csc = vec![0f32; n * cw];
        let mut ikv = vec![0f32; n * iw];
        let mut isc = vec![0f32; n * iw];
        let mut iwt = vec![0f32; n * hp.idx_heads];
        {
            let State { cur, scratch, .. } = &mut *st;
            let mut mats: Vec<(&Mat, &mut [f32])> = vec![(&l.q_a, &mut qa), (&l.kv, &mut kv)];
            if let Some(c) = &l.comp {
                mats.push((&c.kv, &mut ckv));
                mats.push((&c.gate, &mut csc));
            }
            if let Some(ix) = &l.indexer {
                mats.push((&ix.proj, &mut iwt));
                mats.push((&ix.comp.kv, &mut ikv));
                mats.push((&ix.comp.gate, &mut isc));
            }
            cx.mats_rows(&mut mats, cur, n, &mut scratch.acts)?;
        }
        // The query LoRA, then q (and the indexer's q) from its normed latent.
        let mut qr = vec![0f32; n * hp.q_lora_rank];
        blocks::rms_norm_all(&qa, hp.q_lora_rank, Some(&l.q_a_norm), hp.rms_eps, &mut qr);
        let mut q = vec![0f32; n * nh * hd];
        let mut qi = vec![0f32; n * hp.idx_heads * hp.idx_dim];
        {
            let mut mats: Vec<(&Mat, &mut [f32])> = vec![(&l.q_b, &mut q)];
            if let Some(ix) = &l.indexer {
                mats.push((&ix.q_b, &mut qi));
            }
            cx.mats_rows(&mut mats, &qr, n, &mut st.scratch.acts)?;
        }
        let mut tmp = vec![0f32; hd.max(hp.idx_dim)];
        let mut cache = Vec::new();
        for t in 0..n {
            rope.cache(st.positions[t], &mut cache);
            for h in q[t * nh * hd..(t + 1) * nh * hd].chunks_exact_mut(hd) {
                tmp[..hd].copy_from_slice(h);
                blocks::rms_norm(&tmp[..hd], None, hp.rms_eps, h);
                rope.apply(&cache, &mut h[hd - r..]);
            }
            let k = &mut kv[t * hd..(t + 1) * hd];
            tmp[..hd].copy_from_slice(k);
            blocks::rms_norm(&tmp[..hd], Some(&l.kv_norm), hp.rms_eps, k);
            rope.apply(&cache, &mut k[hd - r..]);
            if l.indexer.is_some() {
                self.rope_comp.cache(st.positions[t], &mut cache);
                let idim = hp.idx_dim;
                for h in qi[t * hp.idx_heads * idim..(t + 1) * hp.idx_heads * idim]
                    .chunks_exact_mut(idim)
                {
                    self.rope_comp.apply(&cache, &mut h[idim - r..]);
                }
            }
        }
        // The scores' position embeddings.
        if let Some(c) = &l.comp {
            for t in 0..n {
                let j = st.positions[t] as usize % ratio;
                for (s, &a) in csc[t * cw..(t + 1) * cw]
                    .iter_mut()
                    .zip(&c.ape[j * cw..(j + 1) * cw])
                {
                    *s += a;
                }
            }
        }
        if let Some(ix) = &l.indexer {
            for t in 0..n {
                let j = st.positions[t] as usize % 4;
                for (s, &a) in isc[t * iw..(t + 1) * iw]
                    .iter_mut()
                    .zip(&ix.comp.ape[j * iw..(j + 1) * iw])
                {
                    *s += a;
                }
            }
        }
        // The memory rows of the batch.
        let w = lay.width;
        let mut rows = vec![0f32; n * w];
        for t in 0..n {
            let row = &mut rows[t * w..(t + 1) * w];
            row[lay.kv..lay.kv + hd].copy_from_slice(&kv[t * hd..(t + 1) * hd]);
            if ratio != 0 {
                row[lay.comp_kv..lay.comp_kv + cw].copy_from_slice(&ckv[t * cw..(t + 1) * cw]);
                row[lay.comp_score..lay.comp_score + cw]
                    .copy_from_slice(&csc[t * cw..(t + 1) * cw]);
            }
            if ratio == 4 {
                row[lay.idx_kv..lay.idx_kv + iw].copy_from_slice(&ikv[t * iw..(t + 1) * iw]);
                row[lay.idx_score..lay.idx_score + iw].copy_from_slice(&isc[t * iw..(t + 1) * iw]);
            }
        }
        let positions = st.positions.clone();
        let mem = st.mem[il].kv(il)?;
        let (src, blocks) = mem.source_and_blocks(il, &positions, &rows)?;
        // Blocks the batch finishes: their compressed rows.
        let bw = lay.block_width;
        if let Some(c) = &l.comp {
            let mut row = Vec::new();
            for &p in &positions {
                let p = p as usize;
                if !(p + 1).is_multiple_of(ratio) {
                    continue;
                }
                let b = p / ratio;
                let dst = &mut blocks[b * bw..(b + 1) * bw];
                self.compress(
                    &src,
                    p,
                    ratio,
                    (lay.comp_kv, lay.comp_score),
                    hd,
                    &c.norm,
                    &mut row,
                );
                dst[lay.comp_row..lay.comp_row + hd].copy_from_slice(&row);
                if let Some(ix) = &l.indexer {
                    let idim = hp.idx_dim;
                    let k = (lay.idx_kv, lay.idx_score);
                    self.compress(&src, p, 4, k, idim, &ix.comp.norm, &mut row);
                    dst[lay.idx_row..lay.idx_row + idim].copy_from_slice(&row);
                }
            }
        }
        // Attention, one row per task (a row's bits do not depend on the others): the window,
        // then the compressed rows it sees.
        let mut att = vec![0f32; n * nh * hd];
        {
            let out_rows: Vec<std::sync::Mutex<&mut [f32]>> =
                att.chunks_mut(nh * hd).map(std::sync::Mutex::new).collect();
            let ctx = RowAttn {
                hp,
                lay,
                ratio,
                src: &src,
                blocks,
                q: &q,
                qi: &qi,
                iwt: &iwt,
                sinks: &l.sinks,
            };
            cx.pool.run(n, &|t| {
                // Each task locks its own row only: never contended.
                let mut out = out_rows[t].lock().unwrap_or_else(|e| e.into_inner());
                ctx.row(t, positions[t] as usize, &mut out);
            });
        }
        // The ring keeps the batch's rows (the source's borrow ends here).
        st.mem[il].kv(il)?.commit(&positions, &rows, &rows);
        // Undo the rope on each head's output (the inverse rotation at the query's position).
        for t in 0..n {
            rope.cache(positions[t], &mut cache);
            for pair in cache.chunks_exact_mut(2) {
                pair[1] = -pair[1];
            }
            for h in att[t * nh * hd..(t + 1) * nh * hd].chunks_exact_mut(hd) {
                rope.apply(&cache, &mut h[hd - r..]);
            }
        }
        // The grouped low-rank output: group g's heads through rows g·R_o.. of attn_output_a.
        let (g_n, rank) = (hp.o_groups, hp.o_rank);
        let gw = nh * hd / g_n;
        let rb = l.out_a.row_bytes();
        let mut a = vec![0f32; n * g_n * rank];
        let mut gin = vec![0f32; n * gw];
        let mut gout = vec![0f32; n * rank];
        for g in 0..g_n {
            for t in 0..n {
                gin[t * gw..(t + 1) * gw]
                    .copy_from_slice(&att[t * nh * hd + g * gw..t * nh * hd + (g + 1) * gw]);
            }
            let bytes = &l.out_a.bytes()[g * rank * rb..(g + 1) * rank * rb];
            cx.bytes_rows(
                l.out_a.ty,
                bytes,
                rank,
                gw,
                &gin,
                n,
                &mut st.scratch.acts,
                &mut gout,
            )?;
            for t in 0..n {
                a[t * g_n * rank + g * rank..t * g_n * rank + (g + 1) * rank]
                    .copy_from_slice(&gout[t * rank..(t + 1) * rank]);
            }
        }
        st.out.resize(n * d, 0.0);
        let State { out, scratch, .. } = &mut *st;
        cx.mat_rows(&l.out_b, &a, n, &mut scratch.acts, out)
    }

    /// A sub-layer's pre-mix of the streams of `rows` (batch row indices): each row's input
    /// into `out` (`rows.len() × d`), its `post` and `comb` into `keep` (`rows × 20`).
    fn pre(
        &self,
        cx: &Compute,
        st: &mut State,
        w: &HcWeights,
        rows: &[u32],
        out: &mut Vec<f32>,
        keep: &mut Vec<f32>,
    ) -> Result<(), ArchError> {
        let (d, m) = (self.hp.d_model, rows.len());
        let wide = HC * d;
        let flat = self.gather(&st.streams, rows);
        let mut mixes = Vec::new();
        self.mixes(cx, st, w, &flat, m, &mut mixes)?;
        out.resize(m * d, 0.0);
        keep.resize(m * (HC + HC * HC), 0.0);
        for i in 0..m {
            let (pre, post, comb) = self.pre_post_comb(w, &mixes[i * MIX..(i + 1) * MIX]);
            self.collapse(
                &flat[i * wide..(i + 1) * wide],
                &pre,
                &mut out[i * d..(i + 1) * d],
            );
            let k = &mut keep[i * (HC + HC * HC)..(i + 1) * (HC + HC * HC)];
            k[..HC].copy_from_slice(&post);
            k[HC..].copy_from_slice(&comb);
        }
        Ok(())
    }

    /// The streams of `rows` after a sub-layer whose output rows are `f`, mixed by `keep`.
    fn post(&self, streams: &mut [f32], rows: &[u32], f: &[f32], keep: &[f32]) {
        let d = self.hp.d_model;
        let wide = HC * d;
        let kw = HC + HC * HC;
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            let k = &keep[i * kw..(i + 1) * kw];
            self.expand(
                &mut streams[r * wide..(r + 1) * wide],
                &f[i * d..(i + 1) * d],
                &k[..HC],
                &k[HC..],
            );
        }
    }
}

impl Arch for Deepseek4 {
    fn common(&self) -> &Common {
        &self.common
    }

    /// The attention sub-layer between its stream mixes, then the FFN's pre-mix of the FFN
    /// rows: the routed experts' input (`st.h`, after `ffn_norm`) and the shared expert's
    /// output (`st.side`); the mix waits in `st.stream_mix` for [`Arch::finish_layer`].
    fn dense(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let (d, eps) = (self.hp.d_model, self.hp.rms_eps);
        let n = st.n_rows;
        let l = &self.layers[il];
        if il == 0 {
            // Every stream starts as the token's embedding.
            st.streams.resize(n * HC * d, 0.0);
            for t in 0..n {
                for s in 0..HC {
                    let (x, streams) = (&st.x, &mut st.streams);
                    streams[(t * HC + s) * d..(t * HC + s + 1) * d]
                        .copy_from_slice(&x[t * d..(t + 1) * d]);
                }
            }
        }
        let all: Vec<u32> = (0..n as u32).collect();
        let (mut u, mut keep) = (Vec::new(), Vec::new());
        self.pre(cx, st, &l.hc_attn, &all, &mut u, &mut keep)?;
        blocks::rms_norm_all(&u, d, Some(&l.attn_norm), eps, &mut st.cur);
        st.mark(il, "RMS_NORM", "attn_norm");
        self.attention(cx, st, il)?;
        st.mark(il, "ATTN", "attn");
        self.post(&mut st.streams, &all, &st.out, &keep);
        // The FFN's input: the pre-mix of the FFN rows, normed.
        let rows = st.ffn_rows.clone();
        let mut mix = std::mem::take(&mut st.stream_mix);
        self.pre(cx, st, &l.hc_ffn, &rows, &mut u, &mut mix)?;
        st.stream_mix = mix;
        st.h.resize(rows.len() * d, 0.0);
        blocks::rms_norm_all(&u, d, Some(&l.ffn_norm), eps, &mut st.h);
        st.mark(il, "RMS_NORM", "ffn_norm");
        let State {
            h, side, scratch, ..
        } = st;
        l.shared.run(cx, scratch, h, rows.len(), side)
    }

    fn selection_bias(&self, layer: usize) -> Option<&[f32]> {
        self.layers.get(layer)?.probs_bias.as_deref()
    }

    fn fixed_experts(&self, layer: usize, token: u32) -> Option<&[u32]> {
        let k = self.hp.n_expert_used;
        let t = token as usize;
        self.layers
            .get(layer)?
            .hash
            .as_deref()
            .and_then(|ids| ids.get(t * k..(t + 1) * k))
    }

    /// ggml's `swiglu_clamp` where the file limits the layer's experts.
    fn split_glu(&self, layer: usize) -> Option<Glu> {
        self.common.layers.get(layer)?.moe.as_ref()?;
        Some(glu_for(self.hp.clamp_exp[layer]))
    }

    /// The experts' sum plus the shared expert's, mixed into the FFN rows' streams.
    fn finish_layer(&self, _cx: &Compute, st: &mut State, _layer: usize) -> Result<(), ArchError> {
        let d = self.hp.d_model;
        let rows = st.ffn_rows.clone();
        let m = rows.len() * d;
        for (a, &b) in st.moe_out[..m].iter_mut().zip(&st.side[..m]) {
            *a += b;
        }
        self.post(&mut st.streams, &rows, &st.moe_out, &st.stream_mix);
        Ok(())
    }

    /// The streams collapsed by the head's mix, then the final norm and the output.
    fn head(&self, cx: &Compute, st: &mut State) -> Result<(), ArchError> {
        let d = self.hp.d_model;
        let wide = HC * d;
        let rows = st.out_rows.clone();
        let m = rows.len();
        let flat = self.gather(&st.streams, &rows);
        let mut mixes = Vec::new();
        self.mixes(cx, st, &self.head_hc, &flat, m, &mut mixes)?;
        let w = &self.head_hc;
        let mut y = vec![0f32; d];
        for (i, &r) in rows.iter().enumerate() {
            let mut pre = [0f32; HC];
            for s in 0..HC {
                pre[s] = sigmoid(mixes[i * HC + s] * w.scale[0] + w.base[s]) + self.hp.hc_eps;
            }
            self.collapse(&flat[i * wide..(i + 1) * wide], &pre, &mut y);
            let r = r as usize;
            st.x[r * d..(r + 1) * d].copy_from_slice(&y);
        }
        norm_head(
            cx,
            st,
            &self.common.output_norm,
            &self.common.output,
            self.hp.rms_eps,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{Value, ValueType};

    /// The `deepseek4.*` keys of a 4-layer model (ratios 0, 4, 128, 4; one hash layer), with
    /// `change` applied: `(key, Some(value))` sets it, `(key, None)` removes it.
    fn file_with(change: &[(&str, Option<Value>)]) -> GgufFile {
        let u32s =
            |v: &[u32]| Value::Array(ValueType::U32, v.iter().map(|&x| Value::U32(x)).collect());
        let f32s =
            |v: &[f32]| Value::Array(ValueType::F32, v.iter().map(|&x| Value::F32(x)).collect());
        crate::arch::meta::test_file(
            ARCH,
            &[
                ("block_count", Value::U32(4)),
                ("context_length", Value::U32(4096)),
                ("embedding_length", Value::U32(256)),
                ("attention.head_count", Value::U32(4)),
                ("attention.head_count_kv", Value::U32(1)),
                ("attention.key_length", Value::U32(64)),
                ("attention.value_length", Value::U32(64)),
                ("rope.dimension_count", Value::U32(16)),
                ("rope.freq_base", Value::F32(1e4)),
                ("attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
                ("attention.q_lora_rank", Value::U32(128)),
                ("attention.sliding_window", Value::U32(16)),
                ("expert_count", Value::U32(16)),
                ("expert_used_count", Value::U32(4)),
                ("expert_feed_forward_length", Value::U32(256)),
                ("expert_shared_count", Value::U32(1)),
                ("expert_weights_scale", Value::F32(1.5)),
                ("expert_weights_norm", Value::Bool(true)),
                ("expert_gating_func", Value::U32(4)),
                ("swiglu_clamp_exp", f32s(&[1.0; 4])),
                ("attention.indexer.head_count", Value::U32(8)),
                ("attention.indexer.key_length", Value::U32(32)),
                ("attention.indexer.top_k", Value::U32(4)),
                ("attention.output_group_count", Value::U32(2)),
                ("attention.output_lora_rank", Value::U32(32)),
                ("attention.compress_rope_freq_base", Value::F32(1.6e5)),
                ("attention.compress_ratios", u32s(&[0, 4, 128, 4])),
                ("hyper_connection.count", Value::U32(4)),
                ("hyper_connection.sinkhorn_iterations", Value::U32(20)),
                ("hyper_connection.epsilon", Value::F32(1e-6)),
                ("hash_layer_count", Value::U32(1)),
            ],
            change,
        )
    }

    fn error(f: &GgufFile) -> String {
        HParams::from_gguf(f).expect_err("refused").to_string()
    }

    #[test]
    fn what_it_does_not_run_is_refused_by_key() {
        // Every key fine: the first thing missing is a tensor.
        assert!(error(&file_with(&[])).contains("token_embd.weight"));
        let u32s =
            |v: &[u32]| Value::Array(ValueType::U32, v.iter().map(|&x| Value::U32(x)).collect());
        for (change, key) in [
            (
                ("expert_gating_func", Some(Value::U32(2))),
                "expert_gating_func",
            ),
            (
                ("hyper_connection.count", Some(Value::U32(2))),
                "hyper_connection.count",
            ),
            (
                ("attention.compress_ratios", Some(u32s(&[0, 4, 8, 4]))),
                "compress_ratios",
            ),
            (
                ("attention.compress_ratios", Some(u32s(&[0, 4, 128]))),
                "compress_ratios",
            ),
            (("attention.compress_ratios", None), "compress_ratios"),
            (
                ("attention.head_count_kv", Some(Value::U32(2))),
                "head_count_kv",
            ),
            (
                ("attention.value_length", Some(Value::U32(48))),
                "value_length",
            ),
            (
                ("attention.output_group_count", Some(Value::U32(3))),
                "output_group_count",
            ),
            (
                ("hash_layer_count", Some(Value::U32(5))),
                "hash_layer_count",
            ),
            (
                ("rope.dimension_count", Some(Value::U32(15))),
                "rope.dimension_count",
            ),
            (
                ("attention.indexer.key_length", Some(Value::U32(8))),
                "indexer.key_length",
            ),
            (
                ("expert_group_count", Some(Value::U32(4))),
                "expert_group_count",
            ),
            (
                (
                    "swiglu_clamp_exp",
                    Some(Value::Array(ValueType::F32, vec![Value::F32(1.0); 2])),
                ),
                "swiglu_clamp_exp",
            ),
            (
                ("nextn_predict_layers", Some(Value::U32(4))),
                "nextn_predict_layers",
            ),
        ] {
            let e = error(&file_with(&[change]));
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn a_ring_row_and_a_block_row_hold_each_part_once() {
        let f = file_with(&[]);
        let m = Meta::new(&f, ARCH);
        assert_eq!(compress_ratios(&m, 4).unwrap(), [0, 4, 128, 4]);
        // A window-only layer keeps its raw key; ratio 128 adds kv, scores and the row; ratio
        // 4 twice the compressor's channels and the indexer's three parts.
        let hp = |ratio| {
            let h = HParams {
                n_layer: 4,
                d_model: 256,
                n_head: 4,
                head_dim: 64,
                n_rot: 16,
                q_lora_rank: 128,
                n_swa: 16,
                n_expert: 16,
                n_expert_used: 4,
                n_ff_exp: 256,
                n_shared: 1,
                gating: Gating::default(),
                clamp_exp: vec![0.0; 4],
                clamp_shexp: vec![0.0; 4],
                idx_heads: 8,
                idx_dim: 32,
                idx_top_k: 4,
                o_groups: 2,
                o_rank: 32,
                ratios: vec![ratio; 4],
                hash_layers: 0,
                sinkhorn_iters: 20,
                hc_eps: 1e-6,
                rope_base: 1e4,
                compress_rope_base: 1.6e5,
                yarn: None,
                rms_eps: 1e-6,
                n_vocab: 10,
                n_ctx_train: 4096,
            };
            h.layout(ratio)
        };
        assert_eq!((hp(0).width, hp(0).block_width), (64, 0));
        let l = hp(128);
        assert_eq!((l.comp_kv, l.comp_score, l.width), (64, 128, 192));
        assert_eq!((l.comp_row, l.block_width), (0, 64));
        let l = hp(4);
        assert_eq!(
            (l.comp_kv, l.comp_score, l.idx_kv, l.idx_score),
            (64, 192, 320, 384)
        );
        assert_eq!(l.width, 448);
        assert_eq!((l.comp_row, l.idx_row, l.block_width), (0, 64, 96));
    }
}
