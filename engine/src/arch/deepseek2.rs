//! `deepseek2` (DeepSeek-V2/V2.5/V2-Lite, Moonlight/Kimi-style files), after llama.cpp's
//! `src/models/deepseek2.cpp`, in the **absorbed MLA** form it runs for files that split
//! `attn_kv_b` into `attn_k_b` and `attn_v_b` (`attention.key_length_mla` and
//! `value_length_mla` set).
//!
//! Layer: `attn_norm` (RMS) → multi-head latent attention → residual → `ffn_norm` (RMS) → a
//! dense SiLU-GLU FFN (the first `leading_dense_block_count` layers) or routed SiLU-GLU experts
//! plus `expert_shared_count` shared experts (one dense SiLU-GLU of their summed width, no
//! gate), summed → residual. Then `output_norm` and the head.
//!
//! **Attention.** Per row: `q = wq · x`, or `wq_b · rms(wq_a · x, attn_q_a_norm)` where the
//! file has a query LoRA (`attention.q_lora_rank` > 0); per head `q = [q_nope | q_pe]`
//! (`key_length_mla − rope` and `rope.dimension_count` values). `wkv_a_mqa · x` gives the
//! latent `c` (`kv_lora_rank` values, then `rms(c, attn_kv_a_norm)`) and one shared `k_pe`.
//! `q_pe` and `k_pe` take the original (adjacent-pair) rotary embedding, YaRN where the file
//! says. Absorbed: per head `q_abs = wk_b[h] · q_nope` (`kv_lora_rank` values); the query
//! `[q_abs | q_pe]` attends to one key per position `[c | k_pe]` shared by every head (MQA),
//! whose value is `c`; a head's output goes through `wv_b[h]` to `value_length_mla` values,
//! then `attn_output`. Scores are scaled by `mscale² / √key_length_mla` with `mscale` YaRN's
//! magnitude times `1 + 0.1 · yarn_log_multiplier · ln(factor)` (llama.cpp's
//! "TAG_DEEPSEEK2_YARN_LOG_MUL_FIX").
//!
//! **Memory**: the row `[c | k_pe]` per position ([`LayerMemory::Latent`]), `kv_lora_rank +
//! rope` floats — the attention reads a value as the row itself and keeps its first
//! `kv_lora_rank` outputs.
//!
//! **Routing**: softmax (or sigmoid, `expert_gating_func` 2, selecting by score +
//! `exp_probs_b`) over the experts, top-k, renormalised where `expert_weights_norm` says, ×
//! `expert_weights_scale`; with `expert_group_count` > 1 (DeepSeek-V2 236B, V3, Kimi-K2) only
//! the experts of the `expert_group_used_count` groups whose two best selection scores sum
//! highest are selectable (llama.cpp's grouped top-k). Legacy files with one `attn_kv_b`, a
//! query temperature (`attention.temperature_scale`) and an MTP block are refused by name.

use super::blocks::{self, AttnShape, Compute, Glu, Rope, RopeKind, Yarn};
use super::layers::{finish_with_shared, residual_then_ffn, GluFfn};
use super::meta::{leading_dense, moe_params, n_vocab, yarn_params, Meta};
use super::mla::{Mla, MlaDims};
use super::state::{LayerMemory, State};
use super::weights::Loader;
use super::{Arch, ArchError, Common, CommonLayer, Dims, Experts};
use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use bmoe_core::{Gating, GatingFunc};
use std::sync::Arc;

pub const ARCH: &str = "deepseek2";

/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX` and `_SIGMOID`.
const GATING_FUNC_SOFTMAX: usize = 1;
const GATING_FUNC_SIGMOID: usize = 2;

/// Hyper-parameters, read and checked once at load.
#[derive(Clone, Debug, PartialEq)]
pub struct HParams {
    pub n_layer: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub d_model: usize,
    pub n_ff_exp: usize,
    /// The leading dense layers' FFN width (`feed_forward_length`).
    pub n_ff: usize,
    /// Layers `0..n_dense_lead` run a dense FFN, the rest routed experts.
    pub n_dense_lead: usize,
    pub n_shared: usize,
    pub n_head: usize,
    /// The query LoRA's rank (0: one `attn_q` projection).
    pub q_lora_rank: usize,
    /// The latent's width (`attention.kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// A head's q·k width (`key_length_mla`): `nope + rope`.
    pub k_mla: usize,
    /// A head's value width after `wv_b` (`value_length_mla`).
    pub v_mla: usize,
    /// The rotary part of a head's q·k (`rope.dimension_count`).
    pub n_rot: usize,
    pub gating: Gating,
    pub n_ctx_train: usize,
    pub rope_base: f32,
    pub yarn: Option<Yarn>,
    /// `rope.scaling.yarn_log_multiplier` as llama.cpp uses it (the file's value ÷ 0.1).
    pub yarn_log_mul: f32,
    pub rms_eps: f32,
    pub n_vocab: usize,
}

impl HParams {
    pub fn from_gguf(f: &GgufFile) -> Result<HParams, ArchError> {
        let m = Meta::new(f, ARCH);
        let block_count = m.req_u("block_count")?;
        m.check_range("block_count", block_count, 1, 4096)?;
        if m.opt_u("nextn_predict_layers")?.unwrap_or(0) > 0 {
            return Err(m.err(
                "nextn_predict_layers",
                "is set: this build does not run deepseek2's MTP block (GLM-4.7 Lite's); a file without it loads",
            ));
        }
        let n_layer = block_count;
        let d_model = m.req_u("embedding_length")?;
        if d_model == 0 {
            return Err(m.err("embedding_length", "must be positive"));
        }
        let n_head = m.req_u("attention.head_count")?;
        m.check_range("attention.head_count", n_head, 1, 1024)?;
        let (n_expert, n_expert_used, n_ff_exp) = moe_params(&m)?;
        let (n_dense_lead, n_ff) = leading_dense(&m, n_layer, false)?;
        let n_shared = m.req_u("expert_shared_count")?;
        m.check_range("expert_shared_count", n_shared, 0, 64)?;
        let (Some(k_mla), Some(v_mla)) = (
            m.opt_u("attention.key_length_mla")?,
            m.opt_u("attention.value_length_mla")?,
        ) else {
            return Err(m.err(
                "attention.key_length_mla",
                "is missing: a legacy deepseek2 file with one attn_kv_b, which this build does not run; \
                 llama.cpp's convert_hf_to_gguf.py of 2025-06 or later writes the split attn_k_b / attn_v_b it reads",
            ));
        };
        let n_rot = m.req_u("rope.dimension_count")?;
        if n_rot == 0 || n_rot % 2 != 0 || n_rot >= k_mla {
            return Err(m.err(
                "rope.dimension_count",
                format!("is {n_rot}: expected an even count under key_length_mla {k_mla}"),
            ));
        }
        if v_mla == 0 {
            return Err(m.err("attention.value_length_mla", "is 0"));
        }
        let kv_lora_rank = m.req_u("attention.kv_lora_rank")?;
        if kv_lora_rank == 0 {
            return Err(m.err("attention.kv_lora_rank", "is 0"));
        }
        let q_lora_rank = m.opt_u("attention.q_lora_rank")?.unwrap_or(0);
        if m.opt_f("attention.temperature_scale", 0.0)? != 0.0 {
            return Err(m.err(
                "attention.temperature_scale",
                "is set (Mistral-Large's query temperature), which this build does not run",
            ));
        }
        // Grouped selection (DeepSeek-V2/V3, Kimi-K2): whole groups of consecutive experts.
        let groups = m.opt_u("expert_group_count")?.unwrap_or(0);
        let groups_used = m.opt_u("expert_group_used_count")?.unwrap_or(0);
        if groups > 1 {
            if groups > bmoe_core::gating::MAX_GROUPS
                || n_expert % groups != 0
                || n_expert / groups < 2
            {
                return Err(m.err(
                    "expert_group_count",
                    format!(
                        "is {groups}: expected at most {} groups of at least 2 of the {n_expert} experts each",
                        bmoe_core::gating::MAX_GROUPS
                    ),
                ));
            }
            if groups_used == 0
                || groups_used >= groups
                || n_expert_used > groups_used * (n_expert / groups)
            {
                return Err(m.err(
                    "expert_group_used_count",
                    format!(
                        "is {groups_used}: expected 1..{groups} groups holding at least expert_used_count {n_expert_used} experts"
                    ),
                ));
            }
        }
        let func = match m
            .opt_u("expert_gating_func")?
            .unwrap_or(GATING_FUNC_SOFTMAX)
        {
            0 | GATING_FUNC_SOFTMAX => GatingFunc::Softmax,
            GATING_FUNC_SIGMOID => GatingFunc::Sigmoid,
            other => {
                return Err(m.err(
                    "expert_gating_func",
                    format!("is {other}: expected 1 (softmax) or 2 (sigmoid)"),
                ))
            }
        };
        let renormalize = m.opt_bool("expert_weights_norm")?.unwrap_or(false);
        let scale = m.opt_f("expert_weights_scale", 0.0)?;
        let n_ctx_train = m.req_u("context_length")?;
        let yarn = yarn_params(&m, n_ctx_train)?;
        Ok(HParams {
            n_layer,
            n_expert,
            n_expert_used,
            d_model,
            n_ff_exp,
            n_ff,
            n_dense_lead,
            n_shared,
            n_head,
            q_lora_rank,
            kv_lora_rank,
            k_mla,
            v_mla,
            n_rot,
            gating: Gating {
                func,
                renormalize,
                scale,
                groups: 0,
                groups_used: 0,
            }
            .with_groups(groups as u16, groups_used as u16),
            n_ctx_train,
            rope_base: m.opt_f("rope.freq_base", 10_000.0)?,
            yarn,
            // [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: the converter stores it × 0.1.
            yarn_log_mul: m.opt_f("rope.scaling.yarn_log_multiplier", 0.0)? / 0.1,
            rms_eps: m.req_f("attention.layer_norm_rms_epsilon")?,
            n_vocab: n_vocab(f)?,
        })
    }

    /// A head's non-rotary q·k part.
    pub fn nope(&self) -> usize {
        self.k_mla - self.n_rot
    }

    /// The latent memory's row: the latent and the roped key part.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.n_rot
    }

    /// The latent attention's widths.
    pub fn mla(&self) -> MlaDims {
        MlaDims {
            d_model: self.d_model,
            n_head: self.n_head,
            q_lora_rank: self.q_lora_rank,
            kv_lora_rank: self.kv_lora_rank,
            k_mla: self.k_mla,
            v_mla: self.v_mla,
            n_rot: self.n_rot,
            rms_eps: self.rms_eps,
        }
    }
}

struct LayerWeights {
    attn_norm: Vec<f32>,
    attn: Mla,
    ffn_norm: Vec<f32>,
    /// A leading dense layer's FFN, or a MoE layer's shared experts.
    ffn: GluFfn,
    probs_bias: Option<Vec<f32>>,
}

/// A loaded deepseek2 model.
pub struct Deepseek2 {
    pub hp: HParams,
    common: Common,
    layers: Vec<LayerWeights>,
    rope: Rope,
    shape: AttnShape,
}

/// Load `file` as deepseek2 (the registry's loader).
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    Ok(Box::new(Deepseek2::load(file, mode)?))
}

impl Deepseek2 {
    /// Check every tensor's presence, shape and type, and map the dense ones.
    pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Deepseek2, ArchError> {
        let hp = HParams::from_gguf(&file)?;
        let mut ld = Loader::new(file, mode, hp.n_layer);
        let d = hp.d_model;
        let dims = hp.mla();
        let (embd, output, output_norm) =
            ld.embedding_and_head(d, hp.n_vocab, "output_norm.weight")?;
        let mut layers = Vec::with_capacity(hp.n_layer);
        let mut common_layers = Vec::with_capacity(hp.n_layer);
        for i in 0..hp.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            if ld.has(&n("attn_kv_b")) && !ld.has(&n("attn_k_b")) {
                return Err(ArchError::Tensor {
                    file: ld.file().path().display().to_string(),
                    tensor: n("attn_kv_b"),
                    what: "is the legacy unsplit form, which this build does not run (re-convert with llama.cpp's convert_hf_to_gguf.py for attn_k_b / attn_v_b)".into(),
                });
            }
            let attn = Mla::load(&mut ld, i, &dims, false)?;
            let attn_norm = ld.vector(&n("attn_norm"), d)?;
            let ffn_norm = ld.vector(&n("ffn_norm"), d)?;
            let (ffn, probs_bias, moe) = if i < hp.n_dense_lead {
                (GluFfn::load(&mut ld, i, "", d, hp.n_ff)?, None, None)
            } else {
                let bias_name = format!("blk.{i}.exp_probs_b.bias");
                let probs_bias = if ld.has(&bias_name) {
                    if hp.gating.func != GatingFunc::Sigmoid {
                        return Err(ArchError::Tensor {
                            file: ld.file().path().display().to_string(),
                            tensor: bias_name,
                            what: "is a selection bias on softmax gating, which this build does not run (only with expert_gating_func 2, sigmoid)".into(),
                        });
                    }
                    Some(ld.vector(&bias_name, hp.n_expert)?)
                } else {
                    None
                };
                let fs = hp.n_ff_exp * hp.n_shared;
                if fs == 0 {
                    return Err(ArchError::Key {
                        file: ld.file().path().display().to_string(),
                        key: format!("{ARCH}.expert_shared_count"),
                        what: "is 0, but deepseek2's MoE layers always have shared experts".into(),
                    });
                }
                let shared = GluFfn::load(&mut ld, i, "_shexp", d, fs)?;
                let exps = ld.glu_experts(i, d, hp.n_ff_exp, hp.n_expert)?;
                let moe = Experts {
                    router: ld.mat(&n("ffn_gate_inp"), d, hp.n_expert)?,
                    router_bias: None,
                    exps,
                };
                (shared, probs_bias, Some(moe))
            };
            layers.push(LayerWeights {
                attn_norm,
                attn,
                ffn_norm,
                ffn,
                probs_bias,
            });
            common_layers.push(CommonLayer {
                memory: LayerMemory::Latent {
                    width: hp.latent_width(),
                },
                moe,
            });
        }
        let rope = match hp.yarn {
            None => Rope::plain(RopeKind::Normal, hp.n_rot, hp.rope_base),
            Some(y) => {
                let mut rope = Rope::yarn(RopeKind::Normal, hp.n_rot, hp.rope_base, y);
                if y.factor > 1.0 && hp.yarn_log_mul != 0.0 {
                    // llama.cpp's context set-up for deepseek2 with a log multiplier: YaRN's
                    // magnitude is cancelled in the rotation (attn_factor = 1 / (1 + 0.1 ln f)
                    // against the kernel's own 1 + 0.1 ln f) and applied to the scores below.
                    rope.attn_factor = y.attn_factor / (1.0 + 0.1 * y.factor.ln());
                }
                rope
            }
        };
        // kq_scale = mscale² / √k_mla, mscale from the magnitude the rotation was given back
        // (attn_factor_org) times the log multiplier's (deepseek2.cpp).
        let ln_inv_fs = (1.0 / rope.freq_scale).ln();
        let attn_factor_org = rope.attn_factor * (1.0 + 0.1 * ln_inv_fs);
        let mscale = attn_factor_org * (1.0 + 0.1 * hp.yarn_log_mul * ln_inv_fs);
        let shape = AttnShape {
            n_head: hp.n_head,
            n_head_kv: 1,
            head_dim: hp.latent_width(),
            scale: mscale * mscale / (hp.k_mla as f32).sqrt(),
            window: None,
            softcap: None,
        };
        Ok(Deepseek2 {
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
            rope,
            shape,
            hp,
            layers,
        })
    }
}

impl Arch for Deepseek2 {
    fn common(&self) -> &Common {
        &self.common
    }

    /// Attention, then a leading layer's dense FFN into the residual, or a MoE layer's FFN
    /// norm (the routed experts' input, `st.h`) and its shared experts (into `st.side`).
    fn dense(&self, cx: &Compute, st: &mut State, il: usize) -> Result<(), ArchError> {
        let (d, eps) = (self.hp.d_model, self.hp.rms_eps);
        let l = &self.layers[il];
        blocks::rms_norm_all(&st.x, d, Some(&l.attn_norm), eps, &mut st.cur);
        st.mark(il, "RMS_NORM", "attn_norm");
        let dims = self.hp.mla();
        l.attn.run(cx, st, il, &dims, &self.rope, &self.shape)?;
        st.mark(il, "ATTN", "attn");
        let dense = il < self.hp.n_dense_lead;
        residual_then_ffn(cx, st, il, dense, &l.ffn, &l.ffn_norm, d, eps)
    }

    fn selection_bias(&self, layer: usize) -> Option<&[f32]> {
        self.layers.get(layer)?.probs_bias.as_deref()
    }

    /// The routed experts' sum plus the shared experts', then the residual (llama.cpp's order).
    fn finish_layer(&self, _cx: &Compute, st: &mut State, _layer: usize) -> Result<(), ArchError> {
        finish_with_shared(st, self.hp.d_model);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Value;

    /// The `deepseek2.*` keys of a 4-layer MLA model (one dense layer), with `change` applied:
    /// `(key, Some(value))` sets it, `(key, None)` removes it.
    fn file_with(change: &[(&str, Option<Value>)]) -> GgufFile {
        crate::arch::meta::test_file(
            ARCH,
            &[
                ("block_count", Value::U32(4)),
                ("embedding_length", Value::U32(256)),
                ("context_length", Value::U32(4096)),
                ("feed_forward_length", Value::U32(512)),
                ("attention.head_count", Value::U32(4)),
                ("attention.head_count_kv", Value::U32(1)),
                ("attention.key_length_mla", Value::U32(96)),
                ("attention.value_length_mla", Value::U32(64)),
                ("attention.kv_lora_rank", Value::U32(256)),
                ("attention.q_lora_rank", Value::U32(128)),
                ("rope.dimension_count", Value::U32(32)),
                ("attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
                ("expert_count", Value::U32(16)),
                ("expert_used_count", Value::U32(4)),
                ("expert_feed_forward_length", Value::U32(384)),
                ("expert_shared_count", Value::U32(2)),
                ("leading_dense_block_count", Value::U32(1)),
                ("expert_gating_func", Value::U32(1)),
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
        for (change, key) in [
            (
                ("expert_group_count", Some(Value::U32(5))),
                "expert_group_count",
            ),
            (
                ("expert_group_count", Some(Value::U32(16))),
                "expert_group_count",
            ),
            (
                ("expert_group_count", Some(Value::U32(8))),
                "expert_group_used_count",
            ),
            (
                ("attention.key_length_mla", None),
                "attention.key_length_mla",
            ),
            (
                ("nextn_predict_layers", Some(Value::U32(1))),
                "nextn_predict_layers",
            ),
            (
                ("attention.temperature_scale", Some(Value::F32(0.1))),
                "attention.temperature_scale",
            ),
            (
                ("expert_gating_func", Some(Value::U32(3))),
                "expert_gating_func",
            ),
            (
                ("rope.dimension_count", Some(Value::U32(96))),
                "rope.dimension_count",
            ),
            (
                ("rope.dimension_count", Some(Value::U32(31))),
                "rope.dimension_count",
            ),
            (
                ("attention.kv_lora_rank", Some(Value::U32(0))),
                "attention.kv_lora_rank",
            ),
            (
                ("leading_dense_block_count", Some(Value::U32(4))),
                "leading_dense_block_count",
            ),
            (
                ("rope.scaling.type", Some(Value::String("linear".into()))),
                "rope.scaling.type",
            ),
            (
                ("expert_weights_norm", Some(Value::U32(1))),
                "expert_weights_norm",
            ),
        ] {
            let e = error(&file_with(std::slice::from_ref(&change)));
            assert!(e.contains(&format!("{ARCH}.{key}")), "{change:?}: {e}");
        }
    }
}
