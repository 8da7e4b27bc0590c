//! `qwen2moe` (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), after llama.cpp's `src/models/qwen2moe.cpp`.
//!
//! Layer: `attn_norm` (RMS) → GQA attention with q/k/v biases (no q/k norms) and NeoX rotary
//! embedding, scores scaled by 1/√head_dim → residual → `ffn_norm` (RMS) → two FFNs on the same
//! normed input, summed:
//! - the routed experts: router `ffn_gate_inp`, softmax over every expert, top-k, weights the
//!   softmax's **not renormalised**, SiLU-gated experts over the stacked `ffn_{gate,up,down}_exps`;
//! - a **shared expert** every token uses (`ffn_{gate,up,down}_shexp`, SiLU-gated, width
//!   `expert_shared_feed_forward_length`), scaled per token by `σ(ffn_gate_inp_shexp · x)`.
//!   It is dense: resident, counted in the layer's dense bytes, computed in the dense step.
//!
//! then the residual, and `output_norm` + `output` at the end. Every layer is a MoE layer.
//! llama.cpp passes `expert_weights_scale` to its MoE block but never reads the key for this
//! architecture, so the weights are never scaled; nor are they here.

use super::blocks::{self, AttnShape, Compute, Glu, Rope, RopeKind};
use super::layers::{attention_sublayer, finish_with_shared, AttnWeights, GluFfn, SharedExpert};
use super::meta::{attn_params, moe_params, n_vocab, Meta};
use super::state::{LayerMemory, MemoryKind, State};
use super::weights::Loader;
use super::{Arch, ArchError, Common, CommonLayer, Dims, Experts};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use bmoe_core::Gating;
use std::sync::Arc;

pub const ARCH: &str = "qwen2moe";

/// Hyper-parameters, read and checked once at load.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    pub n_layer: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub d_model: usize,
    pub n_ff_exp: usize,
    /// The shared expert's FFN width (`expert_shared_feed_forward_length`, else
    /// `feed_forward_length`, as llama.cpp reads it).
    pub n_ff_shexp: usize,
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
        let n_ff_shexp = match m.opt_u("expert_shared_feed_forward_length")? {
            Some(n) => n,
            None => m.req_u("feed_forward_length")?,
        };
        if n_ff_shexp == 0 {
            return Err(m.err("expert_shared_feed_forward_length", "is 0"));
        }
        Ok(HParams {
            n_layer,
            n_expert,
            n_expert_used,
            d_model,
            n_ff_exp,
            n_ff_shexp,
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

struct LayerWeights {
    attn_norm: Vec<f32>,
    attn: AttnWeights,
    ffn_norm: Vec<f32>,
    shexp: SharedExpert,
}

/// A loaded qwen2moe model.
pub struct Qwen2Moe {
    pub hp: HParams,
    common: Common,
    layers: Vec<LayerWeights>,
    rope: Rope,
    shape: AttnShape,
}

/// Load `file` as qwen2moe (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(Qwen2Moe::load(file, mode)?))
}

impl Qwen2Moe {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Qwen2Moe, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let d = hp.d_model;
        let qd = hp.n_head * hp.head_dim;
        let kvd = hp.n_head_kv * hp.head_dim;
        let (ff, fs) = (hp.n_ff_exp, hp.n_ff_shexp);
        let (embd, output, output_norm) =
            ld.embedding_and_head(d, hp.n_vocab, "output_norm.weight")?;
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
            let ffn_norm = ld.vector(&n("ffn_norm"), d)?;
            common_layers.push(CommonLayer {
                memory: LayerMemory::kv(MemoryKind::Full, hp.n_head_kv, hp.head_dim),
                moe: Some(Experts {
                    router: ld.mat(&n("ffn_gate_inp"), d, hp.n_expert)?,
                    router_bias: None,
                    exps: ld.glu_experts(i, d, ff, hp.n_expert)?,
                }),
            });
            layers.push(LayerWeights {
                attn_norm,
                attn,
                ffn_norm,
                shexp: SharedExpert {
                    gate_inp: ld.vector(&n("ffn_gate_inp_shexp"), d)?,
                    ffn: GluFfn::load(&mut ld, i, "_shexp", d, fs)?,
                },
            });
        }
        Ok(Qwen2Moe {
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
                gating: Gating::SOFTMAX,
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

/// σ(x) as llama.cpp's graph computes the shared expert's gate: `silu(x) / x` (σ(0) = ½
/// where that would divide by zero).
fn shexp_gate(x: f32) -> f32 {
    if x == 0.0 {
        0.5
    } else {
        blocks::silu(x) / x
    }
}

impl Arch for Qwen2Moe {
    fn batches_sequences(&self) -> bool {
        true
    }
    fn common(&self) -> &Common {
        &self.common
    }

    /// Attention, the FFN norm, and the shared expert (into `st.side`).
    fn dense(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let (d, eps) = (self.hp.d_model, self.hp.rms_eps);
        let l = &self.layers[il];
        attention_sublayer(
            cx,
            st,
            il,
            (&l.attn_norm[..], &l.ffn_norm[..]),
            &l.attn,
            &self.shape,
            &self.rope,
            eps,
            None,
            None,
        )?;
        // The shared expert on the FFN rows, scaled by its gate.
        l.shexp.run(cx, st, d, shexp_gate)
    }

    /// The experts' sum plus the shared expert, then the residual (llama.cpp's order).
    fn finish_layer(&self, _cx: &Compute, st: &mut State, _layer: usize) -> Result<(), ArchError> {
        finish_with_shared(st, self.hp.d_model);
        Ok(())
    }
}
