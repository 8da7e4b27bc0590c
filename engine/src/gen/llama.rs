//! The llama-style file the pre-norm families share (qwen3moe, qwen2moe, gpt-oss): the
//! generic `<arch>.*` keys, and the tensors of an embedding, per layer `attn_norm`, q/k/v (with
//! per-head q/k norms, or q/k/v biases), `attn_output`, the FFN norm, the router and the
//! stacked gate/up/down experts, then `output_norm` and the head. A family's plan is this with
//! its [`Style`] and the tensors it adds to each layer (qwen2moe's shared expert, gpt-oss's
//! biases and sinks).
//!
//! Weights follow the generator's two halves (module docs of `gen`): the embedding and the
//! experts write the token half, attention the context half.

use super::{Fallbacks, Fill, GenError, GenOptions, Half, Planned, Want};
use crate::gguf::{GgmlType, Value};

/// How a family's layer differs from the plain llama-style one.
pub(super) struct Style {
    /// Per-head q/k RMS norms (qwen3moe); without them, q/k/v biases (qwen2moe, gpt-oss), and
    /// the attention sharpness scales the q/k projections instead, so attention is as
    /// near-uniform as with the norms.
    pub qk_norms: bool,
    /// Without q/k norms: q/k/v biases (qwen2moe, gpt-oss) or none (llama's Mixtral).
    pub qkv_biases: bool,
    /// The FFN norm's name (gpt-oss names it after the attention it follows).
    pub ffn_norm: &'static str,
}

/// A layer's own tensors beyond the llama-style ones: (name, dims in GGUF order, type, fill).
pub(super) type Extra = (String, Vec<u64>, Want, Fill);

/// The generic `<arch>.*` keys, with `feed_forward_length` = `ff_length` (what the family's
/// loader reads there).
pub(super) fn metadata(o: &GenOptions, ff_length: u32) -> Vec<(String, Value)> {
    let s = &o.shape;
    let a = s.arch.name();
    let k = |n: &str| format!("{a}.{n}");
    vec![
        (k("context_length"), Value::U32(s.n_ctx_train)),
        (k("embedding_length"), Value::U32(s.d_model)),
        (k("block_count"), Value::U32(s.n_layer)),
        (k("feed_forward_length"), Value::U32(ff_length)),
        (k("attention.head_count"), Value::U32(s.n_head)),
        (k("attention.head_count_kv"), Value::U32(s.n_head_kv)),
        (k("attention.key_length"), Value::U32(s.head_dim)),
        (k("attention.value_length"), Value::U32(s.head_dim)),
        (k("rope.freq_base"), Value::F32(s.rope_base)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(s.rms_eps)),
        (k("expert_count"), Value::U32(s.n_expert)),
        (k("expert_used_count"), Value::U32(s.n_expert_used)),
        (k("expert_feed_forward_length"), Value::U32(s.n_ff_exp)),
    ]
}

/// Every tensor of a llama-style file of `style`, each layer followed by `extras(layer)`.
pub(super) fn plan(
    o: &GenOptions,
    fallbacks: &mut Fallbacks,
    style: &Style,
    extras: &dyn Fn(u32) -> Vec<Extra>,
) -> Result<Vec<Planned>, GenError> {
    let s = &o.shape;
    let d = s.d_model as u64;
    let nv = o.n_vocab()?;
    let split = s.d_model / 2;
    let q_dim = (s.n_head * s.head_dim) as u64;
    let kv_dim = (s.n_head_kv * s.head_dim) as u64;
    let ff = s.n_ff_exp as u64;
    let ne = s.n_expert as u64;
    let inv = |n: u64| 1.0 / (n as f32).sqrt();
    let model = o.mix_model();
    let mut out = Vec::new();
    let mut push = |name: String, dims: &[u64], want: Want, fill: Fill| {
        out.push(o.planned(&model, name, dims, want, fill, fallbacks));
    };
    let f32v = Want::Keep(GgmlType::F32);
    let rand = |std: f32| Fill::Rand {
        std,
        lo: 0,
        hi: s.d_model,
    };
    push(
        "token_embd.weight".into(),
        &[d, nv],
        Want::Weight(None),
        Fill::Rand {
            std: 1.0,
            lo: 0,
            hi: split,
        },
    );
    for i in 0..s.n_layer {
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        let weight = Want::Weight(Some(i));
        push(b("attn_norm"), &[d], f32v, Fill::Const(1.0));
        let qk_std = if style.qk_norms {
            inv(d)
        } else {
            inv(d) * o.attn_sharpness
        };
        push(b("attn_q"), &[d, q_dim], weight, rand(qk_std));
        push(b("attn_k"), &[d, kv_dim], weight, rand(qk_std));
        push(b("attn_v"), &[d, kv_dim], weight, rand(inv(d)));
        if style.qk_norms {
            for n in ["attn_q_norm", "attn_k_norm"] {
                push(
                    b(n),
                    &[s.head_dim as u64],
                    f32v,
                    Fill::Const(o.attn_sharpness),
                );
            }
        } else if style.qkv_biases {
            // Small q/k/v biases, as trained qwen2 models have.
            for (n, w) in [("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)] {
                push(
                    format!("blk.{i}.{n}.bias"),
                    &[w],
                    f32v,
                    Fill::Rand {
                        std: 0.02,
                        lo: 0,
                        hi: w as u32,
                    },
                );
            }
        }
        // Attention writes only the context half of the residual stream.
        push(
            b("attn_output"),
            &[q_dim, d],
            weight,
            Fill::RandRows {
                std: inv(q_dim),
                half: Half::Context,
                split,
            },
        );
        push(b(style.ffn_norm), &[d], f32v, Fill::Const(1.0));
        push(b("ffn_gate_inp"), &[d, ne], f32v, o.router_fill(i));
        push(b("ffn_gate_exps"), &[d, ff, ne], weight, rand(inv(d)));
        push(b("ffn_up_exps"), &[d, ff, ne], weight, rand(inv(d)));
        // Experts write only the token half, so the context half stays a pure running mean.
        push(
            b("ffn_down_exps"),
            &[ff, d, ne],
            weight,
            Fill::RandRows {
                std: inv(ff),
                half: Half::Token,
                split,
            },
        );
        for (name, dims, want, fill) in extras(i) {
            push(name, &dims, want, fill);
        }
    }
    push("output_norm.weight".into(), &[d], f32v, Fill::Const(1.0));
    if !s.tie_output {
        push(
            "output.weight".into(),
            &[d, nv],
            Want::Weight(None),
            rand(inv(d)),
        );
    }
    Ok(out)
}
