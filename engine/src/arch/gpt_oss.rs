//! `gpt-oss` (gpt-oss-20b, gpt-oss-120b), after llama.cpp's `src/models/openai-moe.cpp`.
//!
//! Layer: `attn_norm` (RMS) → GQA attention with q/k/v biases (no q/k norms), NeoX rotary
//! embedding (YaRN when the file states `rope.scaling.type = yarn`), scores scaled by
//! 1/√head_dim, a learned **sink** logit per query head joining each softmax
//! (`attn_sinks`), the output projection with its bias → residual. Layers alternate
//! **sliding-window** attention (a token sees itself and the `sliding_window − 1` before it;
//! its memory is a ring of that many positions) and full attention: layer `il` slides when
//! `il % pattern < pattern − 1` (`attention.sliding_window_pattern`, 2 by default: even
//! layers slide), or as the key's per-layer booleans say.
//! → `post_attention_norm` (RMS) → router `ffn_gate_inp` **with its bias**, top-k on the raw
//! logits, softmax over the `k` selected (`Gating::TOPK_SOFTMAX`) → experts over the stacked
//! `ffn_{gate,up,down}_exps` **with per-expert biases** (`ffn_{gate,up,down}_exps.bias`, kept
//! resident), activation the clamped SwiGLU `min(g,7)·σ(1.702·min(g,7))·(clamp(u,±7)+1)`
//! (constants fixed in llama.cpp's graph, not in the file) → weighted sum in rank order →
//! residual. Then `output_norm` and `output` (never tied). Every layer is a MoE layer; no
//! shared expert; `expert_weights_scale` is not applied (llama.cpp never reads it here).

use super::blocks::{AttnShape, Compute, Glu, Rope, RopeKind, Yarn};
use super::layers::{attention_sublayer, AttnWeights, FfnBias};
use super::meta::{attn_params, moe_params, n_vocab, yarn_params, Meta};
use super::state::{LayerMemory, MemoryKind, State};
use super::weights::Loader;
use super::{Arch, ArchError, Common, CommonLayer, Dims, Experts};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use bmoe_core::Gating;
use std::sync::Arc;

pub const ARCH: &str = "gpt-oss";

/// The clamped SwiGLU's constants, as llama.cpp's graph fixes them for this architecture.
pub const SWIGLU_ALPHA: f32 = 1.702;
pub const SWIGLU_LIMIT: f32 = 7.0;
/// The experts' activation.
const GLU: Glu = Glu::SwigluOai {
    alpha: SWIGLU_ALPHA,
    limit: SWIGLU_LIMIT,
};

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
    /// `rope.freq_base_swa`: the sliding layers' base (the full layers' when absent).
    pub rope_base_swa: f32,
    /// YaRN, when `rope.scaling.type` is `yarn`.
    pub yarn: Option<Yarn>,
    pub rms_eps: f32,
    /// `attention.sliding_window`: positions a sliding layer sees, itself included.
    pub n_swa: usize,
    /// Per layer: whether it slides.
    pub swa_layers: Vec<bool>,
    pub n_vocab: usize,
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<HParams, ArchError> {
        let m = Meta::new(f, ARCH);
        let n_layer = m.req_u("block_count")?;
        let d_model = m.req_u("embedding_length")?;
        if n_layer == 0 {
            return Err(m.err("block_count", "must be positive"));
        }
        let a = attn_params(&m, d_model)?;
        let (n_expert, n_expert_used, n_ff_exp) = moe_params(&m)?;
        let n_swa = m.req_u("attention.sliding_window")?;
        if n_swa == 0 {
            return Err(m.err(
                "attention.sliding_window",
                "is 0, expected a window of at least one position",
            ));
        }
        let swa_layers = swa_pattern(&m, n_layer)?;
        let n_ctx_train = m.req_u("context_length")?;
        let yarn = yarn_params(&m, n_ctx_train)?;
        Ok(HParams {
            n_layer,
            n_expert,
            n_expert_used,
            d_model,
            n_ff_exp,
            n_head: a.n_head,
            n_head_kv: a.n_head_kv,
            head_dim: a.head_dim,
            n_ctx_train,
            rope_base: a.rope_base,
            rope_base_swa: m.opt_f("rope.freq_base_swa", a.rope_base)?,
            yarn,
            rms_eps: a.rms_eps,
            n_swa,
            swa_layers,
            n_vocab: n_vocab(f)?,
        })
    }
}

/// Which layers slide: `attention.sliding_window_pattern` as one boolean per layer, or as a
/// period `p` (layer `il` slides when `il % p < p − 1`; 0 = every layer), 2 when absent —
/// llama.cpp's reading for this architecture.
fn swa_pattern(m: &Meta, n_layer: usize) -> Result<Vec<bool>, ArchError> {
    const KEY: &str = "attention.sliding_window_pattern";
    let is_array = m.f.get(&m.key(KEY)).is_some_and(|v| v.as_array().is_some());
    if is_array {
        if let Some(v) = m.per_layer_bool(KEY, n_layer)? {
            return Ok(v);
        }
    }
    let p = m.opt_u(KEY)?.unwrap_or(2);
    Ok((0..n_layer).map(|il| p == 0 || il % p < p - 1).collect())
}

struct LayerWeights {
    attn_norm: Vec<f32>,
    attn: AttnWeights,
    o_bias: Vec<f32>,
    sinks: Vec<f32>,
    post_norm: Vec<f32>,
    /// Per expert, resident: gate and up (`n_expert × n_ff_exp`), down (`n_expert × d`).
    gate_b: Vec<f32>,
    up_b: Vec<f32>,
    down_b: Vec<f32>,
}

/// A loaded gpt-oss model.
pub struct GptOss {
    pub hp: HParams,
    common: Common,
    layers: Vec<LayerWeights>,
    /// Full-attention layers' rotation and shape; the sliding layers'.
    rope: Rope,
    rope_swa: Rope,
    shape: AttnShape,
    shape_swa: AttnShape,
}

/// Load `file` as gpt-oss (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(GptOss::load(file, mode)?))
}

impl GptOss {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<GptOss, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let d = hp.d_model;
        let qd = hp.n_head * hp.head_dim;
        let kvd = hp.n_head_kv * hp.head_dim;
        let (ff, ne) = (hp.n_ff_exp, hp.n_expert);
        let embd = ld.mat("token_embd.weight", d, hp.n_vocab)?;
        let output = ld.mat("output.weight", d, hp.n_vocab)?;
        let output_norm = ld.vector("output_norm.weight", d)?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        let mut common_layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let b = |s: &str| format!("blk.{i}.{s}.bias");
            let attn_norm = ld.vector(&n("attn_norm"), d)?;
            let attn = AttnWeights {
                q: ld.mat(&n("attn_q"), d, qd)?,
                k: ld.mat(&n("attn_k"), d, kvd)?,
                v: ld.mat(&n("attn_v"), d, kvd)?,
                o: ld.mat(&n("attn_output"), qd, d)?,
                q_bias: ld.floats_opt(&b("attn_q"), &[qd])?,
                k_bias: ld.floats_opt(&b("attn_k"), &[kvd])?,
                v_bias: ld.floats_opt(&b("attn_v"), &[kvd])?,
                q_norm: None,
                k_norm: None,
            };
            let o_bias = ld.vector(&b("attn_output"), d)?;
            let sinks = ld.vector(&format!("blk.{i}.attn_sinks.weight"), hp.n_head)?;
            let post_norm = ld.vector(&n("post_attention_norm"), d)?;
            common_layers.push(CommonLayer {
                // A sliding layer keeps a ring of its window; a full layer every position.
                memory: LayerMemory::kv(
                    if hp.swa_layers[i] {
                        MemoryKind::Ring { window: hp.n_swa }
                    } else {
                        MemoryKind::Full
                    },
                    hp.n_head_kv,
                    hp.head_dim,
                ),
                moe: Some(Experts {
                    router: ld.mat(&n("ffn_gate_inp"), d, ne)?,
                    router_bias: Some(ld.vector(&b("ffn_gate_inp"), ne)?),
                    exps: vec![
                        ld.experts(&n("ffn_gate_exps"), d, ff, ne)?,
                        ld.experts(&n("ffn_up_exps"), d, ff, ne)?,
                        ld.experts(&n("ffn_down_exps"), ff, d, ne)?,
                    ],
                }),
            });
            layers.push(LayerWeights {
                attn_norm,
                attn,
                o_bias,
                sinks,
                post_norm,
                gate_b: ld.floats(&b("ffn_gate_exps"), &[ff, ne])?,
                up_b: ld.floats(&b("ffn_up_exps"), &[ff, ne])?,
                down_b: ld.floats(&b("ffn_down_exps"), &[d, ne])?,
            });
        }
        let rope_for = |base: f32| match hp.yarn {
            Some(y) => Rope::yarn(RopeKind::Neox, hp.head_dim, base, y),
            None => Rope::plain(RopeKind::Neox, hp.head_dim, base),
        };
        let shape = AttnShape {
            n_head: hp.n_head,
            n_head_kv: hp.n_head_kv,
            head_dim: hp.head_dim,
            scale: 1.0 / (hp.head_dim as f32).sqrt(),
            window: None,
            softcap: None,
        };
        Ok(GptOss {
            common: Common {
                name: ARCH,
                dims: Dims {
                    n_layer: hp.n_layer,
                    n_expert: ne,
                    n_expert_used: hp.n_expert_used,
                    d_model: d,
                    n_vocab: hp.n_vocab,
                    n_ctx_train: hp.n_ctx_train,
                },
                gating: Gating::TOPK_SOFTMAX,
                embd,
                output,
                output_norm,
                rms_eps: hp.rms_eps,
                n_ff_exp: ff,
                glu: GLU,
                layers: common_layers,
                weights: ld.finish(),
            },
            rope: rope_for(hp.rope_base),
            rope_swa: rope_for(hp.rope_base_swa),
            shape_swa: AttnShape {
                window: Some(hp.n_swa),
                ..shape.clone()
            },
            shape,
            hp,
            layers,
        })
    }
}

impl Arch for GptOss {
    fn batches_sequences(&self) -> bool {
        true
    }
    fn common(&self) -> &Common {
        &self.common
    }

    /// Attention with sinks (sliding or full), the residual, and the post-attention norm.
    fn dense(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let l = &self.layers[il];
        let (shape, rope) = if self.hp.swa_layers[il] {
            (&self.shape_swa, &self.rope_swa)
        } else {
            (&self.shape, &self.rope)
        };
        attention_sublayer(
            cx,
            st,
            il,
            (&l.attn_norm[..], &l.post_norm[..]),
            &l.attn,
            shape,
            rope,
            self.hp.rms_eps,
            Some(&l.sinks),
            Some(&l.o_bias),
        )
    }

    fn expert_bias(&self, layer: usize, expert: usize) -> Option<FfnBias<'_>> {
        let (l, ff, d) = (self.layers.get(layer)?, self.hp.n_ff_exp, self.hp.d_model);
        (expert < self.hp.n_expert).then(|| FfnBias {
            gate: &l.gate_b[expert * ff..(expert + 1) * ff],
            up: &l.up_b[expert * ff..(expert + 1) * ff],
            down: &l.down_b[expert * d..(expert + 1) * d],
        })
    }
}
