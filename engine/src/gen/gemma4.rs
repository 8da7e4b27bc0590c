//! `gen --arch gemma4`: the metadata keys and tensors llama.cpp's gemma4 loader reads
//! (`src/models/gemma4.cpp`, `load_arch_hparams` / `load_arch_tensors`).
//!
//! Sliding-window layers use the shape's `n_head_kv` and `head_dim`; global layers (every
//! `global_every`-th) their own (`GemmaShape`). The first `dense_layers` layers have only the
//! dense MLP; the others the MLP beside the routed experts (`ffn_gate_up_exps` fused, and
//! `ffn_down_exps.scale`). Weights follow the generator's two halves: attention writes the
//! context half, the MLP and the experts the token half.

use super::{
    Fallbacks, Family, Fill, GenError, GenOptions, Half, ModelShape, Planned, Preset, Want,
};
use crate::gguf::{GgmlType, Value, ValueType};

pub(super) struct Gemma4;

impl Family for Gemma4 {
    /// A generic size gains gemma4's parts: a dense MLP as wide as qwen2moe's shared expert,
    /// a first dense-only layer, global layers every other one.
    fn generic(&self, preset: Preset, s: &mut ModelShape) {
        s.gemma = Some(GemmaShape::generic(s));
        s.n_ff_shexp = match preset {
            Preset::TinyOdd => 320,
            Preset::Small => 2048,
            _ => 512,
        };
    }

    fn validate(&self, s: &ModelShape) -> Result<(), String> {
        validate(s)
    }

    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError> {
        metadata(&o.shape)
    }

    fn plan(&self, o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
        plan(o, fallbacks)
    }
}

/// What gemma4 adds to a [`ModelShape`].
#[derive(Clone, Debug, PartialEq)]
pub struct GemmaShape {
    /// Every `global_every`-th layer (the last of each group) attends globally; the others
    /// through a sliding window.
    pub global_every: u32,
    /// `attention.sliding_window`.
    pub window: u32,
    /// Global layers' KV heads and head width (window layers: the shape's).
    pub n_head_kv_global: u32,
    pub head_dim_global: u32,
    /// The first `dense_layers` layers have no experts.
    pub dense_layers: u32,
    /// `final_logit_softcapping`.
    pub softcap: f32,
    /// `rope.freq_base_swa` (global layers: the shape's `rope_base`).
    pub rope_base_swa: f32,
}

impl GemmaShape {
    /// For a generic size: global every other layer, a window of 16 (so a test's 100
    /// positions wrap the ring), global heads twice as wide with half the KV heads, the first
    /// layer dense, a cap of 10 so the soft-capping bends the logits.
    pub fn generic(s: &ModelShape) -> GemmaShape {
        GemmaShape {
            global_every: 2,
            window: 16,
            n_head_kv_global: (s.n_head_kv / 2).max(1),
            head_dim_global: 2 * s.head_dim,
            dense_layers: 1,
            softcap: 10.0,
            rope_base_swa: 10_000.0,
        }
    }

    /// Gemma-4-26B-A4B, as its GGUF states it.
    pub fn gemma_4_26b_a4b() -> GemmaShape {
        GemmaShape {
            global_every: 6,
            window: 1024,
            n_head_kv_global: 2,
            head_dim_global: 512,
            dense_layers: 0,
            softcap: 30.0,
            rope_base_swa: 10_000.0,
        }
    }

    fn is_global(&self, layer: u32) -> bool {
        (layer + 1).is_multiple_of(self.global_every)
    }
}

fn gemma(s: &ModelShape) -> Result<&GemmaShape, String> {
    s.gemma
        .as_ref()
        .ok_or_else(|| "gemma4 needs its layer pattern (a gemma4 preset)".to_string())
}

/// Refuse what would not make a working gemma4 file.
fn validate(s: &ModelShape) -> Result<(), String> {
    let g = gemma(s)?;
    if s.n_ff_shexp == 0 || !s.n_ff_shexp.is_multiple_of(32) {
        return Err(format!(
            "--shared-ffn {} must be a positive multiple of 32 (gemma4's dense MLP)",
            s.n_ff_shexp
        ));
    }
    if g.global_every == 0 || g.window == 0 {
        return Err("gemma4: the global-layer period and the window must be positive".into());
    }
    if g.dense_layers >= s.n_layer {
        return Err(format!(
            "gemma4: {} dense layers leave no MoE layer of {}",
            g.dense_layers, s.n_layer
        ));
    }
    if g.n_head_kv_global == 0 || !s.n_head.is_multiple_of(g.n_head_kv_global) {
        return Err(format!(
            "gemma4: {} global KV heads must divide {} heads",
            g.n_head_kv_global, s.n_head
        ));
    }
    if g.head_dim_global == 0 || !g.head_dim_global.is_multiple_of(2) {
        return Err("gemma4: the global head width must be even and positive".into());
    }
    if !(s.n_head * g.head_dim_global).is_multiple_of(32) {
        return Err("gemma4: heads x global head width must be a multiple of 32".into());
    }
    Ok(())
}

/// The `gemma4.*` keys.
fn metadata(s: &ModelShape) -> Result<Vec<(String, Value)>, GenError> {
    let g = gemma(s).map_err(super::GenError::Invalid)?;
    let k = |n: &str| format!("gemma4.{n}");
    let per_layer =
        |f: &dyn Fn(u32) -> Value, t: ValueType| Value::Array(t, (0..s.n_layer).map(f).collect());
    Ok(vec![
        (k("context_length"), Value::U32(s.n_ctx_train)),
        (k("embedding_length"), Value::U32(s.d_model)),
        (k("block_count"), Value::U32(s.n_layer)),
        (k("feed_forward_length"), Value::U32(s.n_ff_shexp)),
        (k("attention.head_count"), Value::U32(s.n_head)),
        (
            k("attention.head_count_kv"),
            per_layer(
                &|l| {
                    Value::U32(if g.is_global(l) {
                        g.n_head_kv_global
                    } else {
                        s.n_head_kv
                    })
                },
                ValueType::U32,
            ),
        ),
        (k("rope.freq_base"), Value::F32(s.rope_base)),
        (k("rope.freq_base_swa"), Value::F32(g.rope_base_swa)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(s.rms_eps)),
        (k("expert_count"), Value::U32(s.n_expert)),
        (k("expert_used_count"), Value::U32(s.n_expert_used)),
        (k("attention.key_length"), Value::U32(g.head_dim_global)),
        (k("attention.value_length"), Value::U32(g.head_dim_global)),
        (k("final_logit_softcapping"), Value::F32(g.softcap)),
        (k("attention.sliding_window"), Value::U32(g.window)),
        (k("attention.shared_kv_layers"), Value::U32(0)),
        (k("embedding_length_per_layer_input"), Value::U32(0)),
        (
            k("attention.sliding_window_pattern"),
            per_layer(&|l| Value::Bool(!g.is_global(l)), ValueType::Bool),
        ),
        (k("attention.key_length_swa"), Value::U32(s.head_dim)),
        (k("attention.value_length_swa"), Value::U32(s.head_dim)),
        (k("expert_feed_forward_length"), Value::U32(s.n_ff_exp)),
        (k("rope.dimension_count"), Value::U32(g.head_dim_global)),
        (k("rope.dimension_count_swa"), Value::U32(s.head_dim)),
    ])
}

/// Every tensor of the file, in llama.cpp's order.
fn plan(
    o: &GenOptions,
    fallbacks: &mut Vec<(String, GgmlType, GgmlType)>,
) -> Result<Vec<Planned>, super::GenError> {
    let s = &o.shape;
    let g = gemma(s).map_err(super::GenError::Invalid)?;
    let d = s.d_model as u64;
    let nv = o.n_vocab()?;
    let split = s.d_model / 2;
    let ff = s.n_ff_exp as u64;
    let fm = s.n_ff_shexp as u64;
    let ne = s.n_expert as u64;
    let inv = |n: u64| 1.0 / (n as f32).sqrt();
    let model = o.mix_model();
    let mut out = Vec::new();
    let mut push = |name: String, dims: &[u64], want: Want, fill: Fill| {
        out.push(o.planned(&model, name, dims, want, fill, fallbacks));
    };
    let f32v = Want::Keep(GgmlType::F32);
    let one = Fill::Const(1.0);
    let rand = |std: f32| Fill::Rand {
        std,
        lo: 0,
        hi: s.d_model,
    };
    let writes = |std: f32, half: Half| Fill::RandRows { std, half, split };
    // The engine scales embedding rows by √d_model (as Gemma does): rows of 1/√d_model reach
    // the residual stream at unit scale, where unit rows would make the token half √d_model
    // times the context half and the router read token identity alone.
    push(
        "token_embd.weight".into(),
        &[d, nv],
        Want::Weight(None),
        Fill::Rand {
            std: inv(d),
            lo: 0,
            hi: split,
        },
    );
    // Global layers' rotary frequency factors, one table for all of them.
    push(
        "rope_freqs.weight".into(),
        &[g.head_dim_global as u64 / 2],
        f32v,
        one,
    );
    for i in 0..s.n_layer {
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        let (hd, nkv) = if g.is_global(i) {
            (g.head_dim_global as u64, g.n_head_kv_global as u64)
        } else {
            (s.head_dim as u64, s.n_head_kv as u64)
        };
        let (qd, kvd) = (s.n_head as u64 * hd, nkv * hd);
        let w = Want::Weight(Some(i));
        push(b("attn_norm"), &[d], f32v, one);
        push(b("attn_q"), &[d, qd], w, rand(inv(d)));
        push(b("attn_k"), &[d, kvd], w, rand(inv(d)));
        push(b("attn_v"), &[d, kvd], w, rand(inv(d)));
        push(
            b("attn_output"),
            &[qd, d],
            w,
            writes(inv(qd), Half::Context),
        );
        // Gemma 4 scores q·k with no 1/√head_dim: q and k norms of sharpness / head_dim^¼ each
        // give the other architectures' scale, so attention stays a near-uniform running mean
        // of the context rather than a sharp look-up.
        let qk_norm = o.attn_sharpness / (hd as f32).powf(0.25);
        for n in ["attn_q_norm", "attn_k_norm"] {
            push(b(n), &[hd], f32v, Fill::Const(qk_norm));
        }
        push(b("post_attention_norm"), &[d], f32v, one);
        push(b("layer_output_scale"), &[1], f32v, Fill::Const(0.9));
        push(b("ffn_norm"), &[d], f32v, one);
        push(b("ffn_gate"), &[d, fm], w, rand(inv(d)));
        push(b("ffn_up"), &[d, fm], w, rand(inv(d)));
        push(b("ffn_down"), &[fm, d], w, writes(inv(fm), Half::Token));
        push(b("post_ffw_norm"), &[d], f32v, one);
        if i < g.dense_layers {
            continue;
        }
        push(b("ffn_gate_inp"), &[d, ne], f32v, o.router_fill(i));
        // The router reads rms_norm(x)/√d ⊙ scale: a scale of √d gives it the normed state.
        push(
            format!("blk.{i}.ffn_gate_inp.scale"),
            &[d],
            f32v,
            Fill::Const((d as f32).sqrt()),
        );
        for n in ["pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"] {
            push(b(n), &[d], f32v, one);
        }
        push(b("ffn_gate_up_exps"), &[d, 2 * ff, ne], w, rand(inv(d)));
        push(
            b("ffn_down_exps"),
            &[ff, d, ne],
            w,
            writes(inv(ff), Half::Token),
        );
        push(
            format!("blk.{i}.ffn_down_exps.scale"),
            &[ne],
            f32v,
            Fill::Ramp { lo: 0.75, hi: 1.25 },
        );
    }
    push("output_norm.weight".into(), &[d], f32v, one);
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
