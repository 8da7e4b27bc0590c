//! `llama` with routed experts (Mixtral-8x7B, Mixtral-8x22B: `general.architecture = llama`,
//! `llama.expert_count` > 0), after llama.cpp's `src/models/llama.cpp`.
//!
//! Layer: `attn_norm` (RMS) → GQA attention (q/k/v and `attn_output` biases where the file has
//! them, no q/k norms) with the original rotary embedding (adjacent pairs; `rope_freqs` where the
//! file has them), scores × `attention.scale` or 1/√head_dim → residual → `ffn_norm` (RMS) →
//! router (`ffn_gate_inp`, softmax over every expert, top-k, renormalised) → SiLU-gated experts
//! over the stacked `ffn_{gate,up,down}_exps`, whose width is `feed_forward_length` (Mixtral
//! states no expert width of its own) → residual. Then `output_norm` and the head. A llama file
//! without experts is a dense model and refused by name; so are a fused `attn_qkv`, rope
//! scaling, and the per-expert tensors of pre-2024 Mixtral conversions.

use super::blocks::{AttnShape, Compute, Glu, Rope, RopeKind};
use super::layers::{attention_sublayer, AttnWeights};
use super::meta::{attn_params, n_vocab, Meta};
use super::state::{LayerMemory, MemoryKind, State};
use super::weights::Loader;
use super::{Arch, ArchError, Common, CommonLayer, Dims, Experts};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use bmoe_core::Gating;
use std::sync::Arc;

pub const ARCH: &str = "llama";

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
    /// `attention.scale`, else 1/√head_dim.
    pub kq_scale: f32,
    pub rms_eps: f32,
    pub n_vocab: usize,
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<HParams, ArchError> {
        let m = Meta::new(f, ARCH);
        // Most llama files are dense models: say so before asking for anything else.
        let n_expert = m.opt_u("expert_count")?.unwrap_or(0);
        if n_expert == 0 {
            return Err(ArchError::NotMoe {
                file: f.path().display().to_string(),
                arch: ARCH.into(),
            });
        }
        let n_layer = m.req_u("block_count")?;
        m.check_range("block_count", n_layer, 1, 4096)?;
        let d_model = m.req_u("embedding_length")?;
        let a = attn_params(&m, d_model)?;
        let n_expert_used = m.req_u("expert_used_count")?;
        m.check_range("expert_used_count", n_expert_used, 1, n_expert)?;
        // Mixtral's experts are `feed_forward_length` wide (llama.cpp's `n_ff`).
        let n_ff_exp = match m.opt_u("expert_feed_forward_length")? {
            Some(n) => n,
            None => m.req_u("feed_forward_length")?,
        };
        if n_ff_exp == 0 {
            return Err(m.err("feed_forward_length", "is 0"));
        }
        match m.opt_str("rope.scaling.type")? {
            None | Some("none") => {}
            Some(other) => {
                return Err(m.err(
                    "rope.scaling.type",
                    format!("is '{other}'; this build runs llama MoE files without rope scaling"),
                ))
            }
        }
        let scale = m.opt_f("attention.scale", 0.0)?;
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
            kq_scale: if scale == 0.0 {
                1.0 / (a.head_dim as f32).sqrt()
            } else {
                scale
            },
            rms_eps: a.rms_eps,
            n_vocab: n_vocab(f)?,
        })
    }
}

struct LayerWeights {
    attn_norm: Vec<f32>,
    attn: AttnWeights,
    o_bias: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
}

/// A loaded llama MoE model.
pub struct LlamaMoe {
    pub hp: HParams,
    common: Common,
    layers: Vec<LayerWeights>,
    rope: Rope,
    shape: AttnShape,
}

/// Load `file` as llama with experts (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(LlamaMoe::load(file, mode)?))
}

impl LlamaMoe {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<LlamaMoe, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let d = hp.d_model;
        let qd = hp.n_head * hp.head_dim;
        let kvd = hp.n_head_kv * hp.head_dim;
        let path = ld.file().path().display().to_string();
        let refuse = |tensor: String, what: &str| ArchError::Tensor {
            file: path.clone(),
            tensor,
            what: what.into(),
        };
        let (embd, output, output_norm) =
            ld.embedding_and_head(d, hp.n_vocab, "output_norm.weight")?;
        // One table for every layer (llama.cpp duplicates layer 0's).
        let rope_freqs = ld.floats_opt("rope_freqs.weight", &[hp.head_dim / 2])?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        let mut common_layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let b = |s: &str| format!("blk.{i}.{s}.bias");
            if ld.has(&n("attn_qkv")) {
                return Err(refuse(
                    n("attn_qkv"),
                    "is a fused q/k/v projection, which this build does not read for llama (split attn_q, attn_k, attn_v)",
                ));
            }
            if ld.has(&n("ffn_gate.0")) || !ld.has(&n("ffn_gate_inp")) {
                return Err(refuse(
                    n("ffn_gate_exps"),
                    "is missing: a llama MoE layer stacks its experts in ffn_{gate,up,down}_exps (a pre-2024 conversion with one tensor per expert must be converted again)",
                ));
            }
            layers.push(LayerWeights {
                attn_norm: ld.vector(&n("attn_norm"), d)?,
                attn: AttnWeights {
                    q: ld.mat(&n("attn_q"), d, qd)?,
                    k: ld.mat(&n("attn_k"), d, kvd)?,
                    v: ld.mat(&n("attn_v"), d, kvd)?,
                    o: ld.mat(&n("attn_output"), qd, d)?,
                    q_bias: ld.floats_opt(&b("attn_q"), &[qd])?,
                    k_bias: ld.floats_opt(&b("attn_k"), &[kvd])?,
                    v_bias: ld.floats_opt(&b("attn_v"), &[kvd])?,
                    q_norm: None,
                    k_norm: None,
                },
                o_bias: ld.floats_opt(&b("attn_output"), &[d])?,
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
        Ok(LlamaMoe {
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
            rope: Rope::plain(RopeKind::Normal, hp.head_dim, hp.rope_base)
                .with_freq_factors(rope_freqs),
            shape: AttnShape {
                n_head: hp.n_head,
                n_head_kv: hp.n_head_kv,
                head_dim: hp.head_dim,
                scale: hp.kq_scale,
                window: None,
                softcap: None,
            },
            hp,
            layers,
        })
    }
}

impl Arch for LlamaMoe {
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
            l.o_bias.as_deref(),
        )
    }
}
