//! `qwen3moe` (Qwen3-30B-A3B, Qwen3-235B-A22B), after llama.cpp's `src/models/qwen3moe.cpp`.
//!
//! Layer: `attn_norm` (RMS) → GQA attention with per-head q/k RMS norms and NeoX rotary
//! embedding, scores scaled by 1/√head_dim → residual → `ffn_norm` (RMS) → router
//! (`ffn_gate_inp`, softmax over every expert, top-k, renormalised) → SiLU-gated experts over
//! the stacked `ffn_{gate,up,down}_exps` → weighted sum in rank order → residual. Then
//! `output_norm` and the head (`output`, or `token_embd` when the file ties them). No shared
//! expert; every layer is a MoE layer.

use super::blocks::{AttnShape, Compute, Glu, Rope, RopeKind};
use super::layers::{attention_sublayer, AttnWeights};
use super::meta::{attn_params, moe_params, n_vocab, Meta};
use super::state::{LayerMemory, MemoryKind, State};
use super::weights::Loader;
use super::{Arch, ArchError, Common, CommonLayer, Dims, Experts};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use bmoe_core::Gating;
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
        Ok(HParams {
            n_layer,
            n_expert,
            n_expert_used,
            d_model,
            n_ff_exp,
            n_head: a.n_head,
            n_head_kv: a.n_head_kv,
            head_dim: a.head_dim,
            n_ctx_train: m.req_u("context_length")?,
            rope_base: a.rope_base,
            rms_eps: a.rms_eps,
            n_vocab: n_vocab(f)?,
        })
    }
}

pub struct LayerWeights {
    attn_norm: Vec<f32>,
    attn: AttnWeights,
    ffn_norm: Vec<f32>,
}

/// A loaded qwen3moe model.
pub struct Qwen3Moe {
    pub hp: HParams,
    common: Common,
    layers: Vec<LayerWeights>,
    rope: Rope,
    shape: AttnShape,
}

/// Load `file` as qwen3moe (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(Qwen3Moe::load(file, mode)?))
}

impl Qwen3Moe {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Qwen3Moe, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let d = hp.d_model;
        let qd = hp.n_head * hp.head_dim;
        let kvd = hp.n_head_kv * hp.head_dim;
        let (embd, output, output_norm) =
            ld.embedding_and_head(d, hp.n_vocab, "output_norm.weight")?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        let mut common_layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(LayerWeights {
                attn_norm: ld.vector(&n("attn_norm"), d)?,
                attn: AttnWeights {
                    q: ld.mat(&n("attn_q"), d, qd)?,
                    k: ld.mat(&n("attn_k"), d, kvd)?,
                    v: ld.mat(&n("attn_v"), d, kvd)?,
                    o: ld.mat(&n("attn_output"), qd, d)?,
                    q_bias: None,
                    k_bias: None,
                    v_bias: None,
                    q_norm: Some(ld.vector(&n("attn_q_norm"), hp.head_dim)?),
                    k_norm: Some(ld.vector(&n("attn_k_norm"), hp.head_dim)?),
                },
                ffn_norm: ld.vector(&n("ffn_norm"), d)?,
            });
            common_layers.push(CommonLayer {
                memory: LayerMemory::kv(MemoryKind::Full, hp.n_head_kv, hp.head_dim),
                moe: Some(Experts {
                    router: ld.mat(&n("ffn_gate_inp"), d, hp.n_expert)?,
                    router_bias: None,
                    exps: ld.glu_experts(i, d, hp.n_ff_exp, hp.n_expert)?,
                }),
            });
        }
        Ok(Qwen3Moe {
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
                gating: Gating::SOFTMAX_RENORM,
                embd,
                output,
                output_norm,
                rms_eps: hp.rms_eps,
                n_ff_exp: hp.n_ff_exp,
                glu: Glu::Silu,
                layers: common_layers,
                weights: ld.finish(),
            },
            rope: Rope::plain(RopeKind::Neox, hp.head_dim, hp.rope_base),
            shape: AttnShape {
                n_head: hp.n_head,
                n_head_kv: hp.n_head_kv,
                head_dim: hp.head_dim,
                scale: 1.0 / (hp.head_dim as f32).sqrt(),
                window: None,
                softcap: None,
            },
            hp,
            layers,
        })
    }
}

impl Arch for Qwen3Moe {
    fn batches_sequences(&self) -> bool {
        true
    }
    fn common(&self) -> &Common {
        &self.common
    }

    fn dense(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let l = &self.layers[il];
        attention_sublayer(
            cx,
            st,
            il,
            (&l.attn_norm[..], &l.ffn_norm[..]),
            &l.attn,
            &self.shape,
            &self.rope,
            self.hp.rms_eps,
            None,
            None,
        )
    }
}
