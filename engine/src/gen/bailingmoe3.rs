//! `gen --arch bailingmoe3`: the metadata keys and tensors llama.cpp's bailingmoe3 loader reads
//! (`src/models/bailingmoe3.cpp`, `load_arch_hparams` / `load_arch_tensors`).
//!
//! Per layer: `attn_norm`; a Kimi Delta Attention layer (`attention.head_count_kv` 0: the
//! convolutions `ssm_conv1d_q/k/v` `[d_conv, 1, d_inner]`, `attn_q/k/v`, the gate's
//! `ssm_f_a`, `ssm_beta`, `ssm_a` `[1, n_head]`, `ssm_dt.bias`, the output gate `ssm_g_a`,
//! `ssm_norm`, `attn_output`) or a latent-attention layer (head_count_kv 1: deepseek2's
//! tensors and the per-head output gate `attn_gate` `[d, n_head]`); then `ffn_norm` and a dense
//! SiLU-GLU FFN (the first `dense_layers`) or the router, its selection bias, the stacked
//! experts and the shared expert. The attention layers are every `mla_every`-th. Weights follow
//! the generator's two halves: the mixers write the context half, the FFNs the token half.

use super::deepseek2::{ffn_tensors, mla_tensors};
use super::{
    Deepseek2Shape, Fallbacks, Family, Fill, GenError, GenOptions, Half, ModelShape, Planned,
    Preset, Want,
};
use crate::gguf::{GgmlType, Value, ValueType};

pub(super) struct BailingMoe3;

/// What bailingmoe3 adds to a [`ModelShape`] (whose `n_head` is both kinds' head count;
/// `head_dim` is stated as `nope + rope`, and `n_head_kv` is 1).
#[derive(Clone, Debug, PartialEq)]
pub struct BailingShape {
    /// The latent attention, the dense layers and the routing, as deepseek2's (sigmoid, no
    /// groups, no YaRN).
    pub mla: Deepseek2Shape,
    /// `kda.head_dim`, `ssm.conv_kernel`, `kda.gate_lower_bound`.
    pub kda_head_dim: u32,
    pub d_conv: u32,
    pub gate_lower_bound: f32,
    /// Layer `i` attends when `(i + 1) % mla_every == 0`; the others are KDA.
    pub mla_every: u32,
    /// `swiglu_clamp_exp` and `swiglu_clamp_shexp` on every layer (0: not written).
    pub swiglu_limit: f32,
}

impl BailingShape {
    /// A generic size's: deepseek2's generic attention, one dense layer, one shared expert,
    /// sigmoid routing renormalised × 2.5; KDA heads as wide as the attention's count makes
    /// `d_model`, a convolution of 4, Kimi's lower bound −5, one attention layer in four; on
    /// tiny-odd, SwiGLUs limited to ±1.
    pub fn generic(preset: Preset, s: &ModelShape) -> BailingShape {
        let mut mla = Deepseek2Shape::generic(preset, s.d_model);
        mla.n_shared = 1;
        mla.sigmoid = true;
        mla.weights_norm = true;
        mla.weights_scale = 2.5;
        BailingShape {
            mla,
            kda_head_dim: s.d_model / s.n_head,
            d_conv: 4,
            gate_lower_bound: -5.0,
            mla_every: 4,
            // tiny-odd limits its SwiGLUs (the converter writes Ling 3.0's lists): 1.0 clamps
            // about a third of the up values and a tenth of the gates.
            swiglu_limit: if preset == Preset::TinyOdd { 1.0 } else { 0.0 },
        }
    }

    pub fn attends(&self, layer: u32) -> bool {
        (layer + 1).is_multiple_of(self.mla_every)
    }
}

fn bs(s: &ModelShape) -> Result<&BailingShape, String> {
    s.bailing
        .as_ref()
        .ok_or_else(|| "bailingmoe3 needs its layer shapes (a bailingmoe3 preset)".to_string())
}

impl Family for BailingMoe3 {
    fn generic(&self, preset: Preset, s: &mut ModelShape) {
        let x = BailingShape::generic(preset, s);
        s.n_head_kv = 1;
        s.head_dim = x.mla.nope + x.mla.rope;
        s.bailing = Some(x);
    }

    fn validate(&self, s: &ModelShape) -> Result<(), String> {
        let x = bs(s)?;
        let m = &x.mla;
        if m.rope == 0 || m.rope % 2 != 0 || m.nope == 0 || m.v_head == 0 || m.kv_lora_rank == 0 {
            return Err(format!(
                "bailingmoe3: nope {}, rope {} (even), value {} and latent {} must be positive",
                m.nope, m.rope, m.v_head, m.kv_lora_rank
            ));
        }
        if !m.sigmoid || m.groups > 1 || s.yarn_factor > 0.0 {
            return Err(
                "bailingmoe3: sigmoid routing with its selection bias, no groups, no rope scaling"
                    .into(),
            );
        }
        if m.dense_layers >= s.n_layer {
            return Err(format!(
                "bailingmoe3: {} dense layers leave no MoE layer of {}",
                m.dense_layers, s.n_layer
            ));
        }
        if m.dense_layers > 0 && (m.n_ff_dense == 0 || !m.n_ff_dense.is_multiple_of(32)) {
            return Err(format!(
                "bailingmoe3: the dense FFN width {} must be a positive multiple of 32",
                m.n_ff_dense
            ));
        }
        if m.n_shared == 0 {
            return Err("bailingmoe3: at least one shared expert".into());
        }
        if s.n_ff_shexp != 0 {
            return Err(
                "--shared-ffn: bailingmoe3's shared expert is expert_shared_count × the expert FFN"
                    .into(),
            );
        }
        if x.kda_head_dim == 0 || !(x.kda_head_dim * s.n_head).is_multiple_of(32) {
            return Err(format!(
                "bailingmoe3: KDA heads of {} × {} heads must be a positive multiple of 32 wide",
                x.kda_head_dim, s.n_head
            ));
        }
        if x.d_conv < 2 || x.gate_lower_bound >= 0.0 || x.mla_every == 0 {
            return Err(format!(
                "bailingmoe3: convolution {} (≥ 2), gate lower bound {} (< 0), attention every {} layers (≥ 1)",
                x.d_conv, x.gate_lower_bound, x.mla_every
            ));
        }
        Ok(())
    }

    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError> {
        let s = &o.shape;
        let x = bs(s).map_err(GenError::Invalid)?;
        let a = &x.mla;
        let k = |n: &str| format!("bailingmoe3.{n}");
        let kv: Vec<Value> = (0..s.n_layer)
            .map(|i| Value::U32(u32::from(x.attends(i))))
            .collect();
        let mut m = vec![
            (k("context_length"), Value::U32(s.n_ctx_train)),
            (k("embedding_length"), Value::U32(s.d_model)),
            (k("block_count"), Value::U32(s.n_layer)),
            (k("feed_forward_length"), Value::U32(a.n_ff_dense)),
            (k("attention.head_count"), Value::U32(s.n_head)),
            (
                k("attention.head_count_kv"),
                Value::Array(ValueType::U32, kv),
            ),
            (
                k("attention.key_length"),
                Value::U32(a.kv_lora_rank + a.rope),
            ),
            (k("attention.value_length"), Value::U32(a.kv_lora_rank)),
            (k("attention.key_length_mla"), Value::U32(a.nope + a.rope)),
            (k("attention.value_length_mla"), Value::U32(a.v_head)),
            (k("attention.q_lora_rank"), Value::U32(a.q_lora_rank)),
            (k("attention.kv_lora_rank"), Value::U32(a.kv_lora_rank)),
            (k("rope.dimension_count"), Value::U32(a.rope)),
            (k("rope.freq_base"), Value::F32(s.rope_base)),
            (k("attention.layer_norm_rms_epsilon"), Value::F32(s.rms_eps)),
            (k("expert_count"), Value::U32(s.n_expert)),
            (k("expert_used_count"), Value::U32(s.n_expert_used)),
            (k("expert_feed_forward_length"), Value::U32(s.n_ff_exp)),
            (
                k("expert_shared_feed_forward_length"),
                Value::U32(s.n_ff_exp * a.n_shared),
            ),
            (k("expert_shared_count"), Value::U32(a.n_shared)),
            (k("leading_dense_block_count"), Value::U32(a.dense_layers)),
            (k("expert_weights_scale"), Value::F32(a.weights_scale)),
            (k("expert_weights_norm"), Value::Bool(a.weights_norm)),
            (k("expert_gating_func"), Value::U32(2)),
            (k("ssm.conv_kernel"), Value::U32(x.d_conv)),
            (k("kda.head_dim"), Value::U32(x.kda_head_dim)),
            (k("kda.safe_gate"), Value::Bool(true)),
            (k("kda.gate_lower_bound"), Value::F32(x.gate_lower_bound)),
        ];
        if x.swiglu_limit > 0.0 {
            let limits = || {
                Value::Array(
                    ValueType::F32,
                    vec![Value::F32(x.swiglu_limit); s.n_layer as usize],
                )
            };
            m.push((k("swiglu_clamp_exp"), limits()));
            m.push((k("swiglu_clamp_shexp"), limits()));
        }
        Ok(m)
    }

    fn plan(&self, o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
        plan(o, fallbacks)
    }
}

/// Every tensor of the file, in the loader's order.
fn plan(o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
    let s = &o.shape;
    let x = bs(s).map_err(GenError::Invalid)?;
    let d = s.d_model as u64;
    let nv = o.n_vocab()?;
    let nh = s.n_head as u64;
    let di = (x.kda_head_dim * s.n_head) as u64;
    let inv = |n: u64| 1.0 / (n as f32).sqrt();
    let model = o.mix_model();
    // llama-quantize ranks the KDA layers' attn_v among themselves.
    let kda_layers: Vec<u32> = (0..s.n_layer).filter(|&i| !x.attends(i)).collect();
    let mut out = Vec::new();
    let mut push = |name: String, dims: &[u64], want: Want, fill: Fill| {
        out.push(o.planned(&model, name, dims, want, fill, fallbacks));
    };
    let f32v = Want::Keep(GgmlType::F32);
    let one = Fill::Const(1.0);
    let rand = |std: f32, width: u32| Fill::Rand {
        std,
        lo: 0,
        hi: width,
    };
    push(
        "token_embd.weight".into(),
        &[d, nv],
        Want::Weight(None),
        rand(1.0, s.d_model / 2),
    );
    for i in 0..s.n_layer {
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        let w = Want::Weight(Some(i));
        push(b("attn_norm"), &[d], f32v, one);
        if x.attends(i) {
            mla_tensors(&mut push, o, i, &x.mla, true);
        } else {
            for p in ["q", "k", "v"] {
                push(
                    b(&format!("ssm_conv1d_{p}")),
                    &[x.d_conv as u64, 1, di],
                    f32v,
                    rand(0.5, x.d_conv),
                );
            }
            push(b("attn_q"), &[d, di], w, rand(inv(d), s.d_model));
            push(b("attn_k"), &[d, di], w, rand(inv(d), s.d_model));
            let rank = kda_layers.iter().position(|&l| l == i).unwrap_or(0) as u32;
            push(
                b("attn_v"),
                &[d, di],
                Want::AttnV {
                    layer: i,
                    rank,
                    of: kda_layers.len() as u32,
                },
                rand(inv(d), s.d_model),
            );
            push(b("ssm_f_a"), &[d, di], w, rand(inv(d), s.d_model));
            push(b("ssm_beta"), &[d, nh], w, rand(inv(d), s.d_model));
            push(format!("blk.{i}.ssm_a"), &[1, nh], f32v, rand(1.0, 1));
            push(
                format!("blk.{i}.ssm_dt.bias"),
                &[di],
                f32v,
                rand(0.5, x.kda_head_dim * s.n_head),
            );
            push(b("ssm_g_a"), &[d, di], w, rand(inv(d), s.d_model));
            push(b("ssm_norm"), &[x.kda_head_dim as u64], f32v, one);
            push(
                b("attn_output"),
                &[di, d],
                w,
                Fill::RandRows {
                    std: inv(di),
                    half: Half::Context,
                    split: s.d_model / 2,
                },
            );
        }
        ffn_tensors(&mut push, o, i, &x.mla, true);
    }
    push("output_norm.weight".into(), &[d], f32v, one);
    if !s.tie_output {
        push(
            "output.weight".into(),
            &[d, nv],
            Want::Weight(None),
            rand(inv(d), s.d_model),
        );
    }
    Ok(out)
}
