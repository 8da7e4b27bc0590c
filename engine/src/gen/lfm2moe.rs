//! `gen --arch lfm2moe`: the metadata keys and tensors llama.cpp's lfm2moe loader reads
//! (`src/models/lfm2moe.cpp`, `load_arch_hparams` / `load_arch_tensors`).
//!
//! Layers listed in [`Lfm2Shape::attn_layers`] attend (`attention.head_count_kv` = the
//! shape's KV heads); the others mix by a short convolution (`head_count_kv` 0) whose
//! `shortconv.conv` taps stay F32 (ggml's `ssm_conv` reads only F32, and llama-quantize never
//! quantizes them). The first `dense_layers` layers run a dense SiLU-GLU FFN, the others routed
//! experts with a per-expert selection bias (`exp_probs_b.bias`). Weights follow the
//! generator's two halves: attention and the convolution write the context half (both mix
//! positions), the dense FFN and the experts the token half.

use super::{
    Fallbacks, Family, Fill, GenError, GenOptions, Half, ModelShape, Planned, Preset, Want,
};
use crate::gguf::{GgmlType, Value, ValueType};

pub(super) struct Lfm2Moe;

/// What lfm2moe adds to a [`ModelShape`].
#[derive(Clone, Debug, PartialEq)]
pub struct Lfm2Shape {
    /// The layers that attend (ascending); every other layer is a short convolution.
    pub attn_layers: Vec<u32>,
    /// `shortconv.l_cache`: the convolution's width.
    pub l_cache: u32,
    /// `leading_dense_block_count`: the first layers run a dense FFN instead of experts.
    pub dense_layers: u32,
    /// The dense FFN's width (`feed_forward_length`).
    pub n_ff_dense: u32,
}

impl Lfm2Shape {
    /// For a generic size of `n_layer` layers: attention on every fourth layer from layer 2
    /// (as LFM2-8B-A1B's first is layer 2), so the last layer of the tiny preset is a
    /// convolution (its state must advance for rows whose logits are not wanted), a width of
    /// 3, one dense layer.
    pub fn generic(n_layer: u32, n_ff_dense: u32) -> Lfm2Shape {
        Lfm2Shape {
            attn_layers: (0..n_layer).filter(|l| l % 4 == 2).collect(),
            l_cache: 3,
            dense_layers: 1,
            n_ff_dense,
        }
    }

    /// LFM2-8B-A1B: attention at layers 2, 6, 10, 14, 18 and 21 of 24, a width of 3, two
    /// dense layers of 7168 (`layer_types`, `conv_L_cache`, `num_dense_layers` and
    /// `intermediate_size` of its config.json, which transformers' `Lfm2MoeConfig` states as
    /// its defaults).
    pub fn lfm2_8b_a1b() -> Lfm2Shape {
        Lfm2Shape {
            attn_layers: vec![2, 6, 10, 14, 18, 21],
            l_cache: 3,
            dense_layers: 2,
            n_ff_dense: 7168,
        }
    }

    pub fn attends(&self, layer: u32) -> bool {
        self.attn_layers.contains(&layer)
    }
}

/// The full shape of LFM2-8B-A1B (its config.json, as transformers' `Lfm2MoeConfig` defaults
/// state it; llama.cpp names 24 layers `LLM_TYPE_8B_A1B`): 24 layers, 32 experts, top-4,
/// d_model 2048, expert FFN 1792, 32 heads of 64 with 8 KV heads, rope base 1e6, RMS eps 1e-5,
/// 128000 positions, tied embeddings.
pub(super) fn full_shape() -> ModelShape {
    ModelShape {
        arch: super::GenArch::Lfm2Moe,
        n_layer: 24,
        n_expert: 32,
        n_expert_used: 4,
        d_model: 2048,
        n_ff_exp: 1792,
        n_ff_shexp: 0,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 64,
        n_ctx_train: 128_000,
        rope_base: 1_000_000.0,
        rms_eps: 1e-5,
        tie_output: true,
        gemma: None,
        lfm2: Some(Lfm2Shape::lfm2_8b_a1b()),
        qwen35: None,
        deepseek2: None,
        bailing: None,
        deepseek4: None,
        n_swa: 0,
        yarn_factor: 0.0,
        yarn_orig_ctx: 0,
    }
}

fn lfm2(s: &ModelShape) -> Result<&Lfm2Shape, String> {
    s.lfm2
        .as_ref()
        .ok_or_else(|| "lfm2moe needs its layer pattern (an lfm2moe preset)".to_string())
}

impl Family for Lfm2Moe {
    /// A generic size gains lfm2moe's layer pattern and a dense FFN as wide as llama.cpp's
    /// K-quants allow (256-multiples, except on tiny-odd).
    fn generic(&self, preset: Preset, s: &mut ModelShape) {
        let ff = match preset {
            Preset::TinyOdd => 320,
            Preset::Small => 2048,
            _ => 512,
        };
        s.lfm2 = Some(Lfm2Shape::generic(s.n_layer, ff));
    }

    fn validate(&self, s: &ModelShape) -> Result<(), String> {
        let l = lfm2(s)?;
        if s.n_head * s.head_dim != s.d_model {
            return Err(format!(
                "lfm2moe: heads {} x head dim {} must be d_model {} (its attn_output is d_model x d_model)",
                s.n_head, s.head_dim, s.d_model
            ));
        }
        if !(2..=64).contains(&l.l_cache) {
            return Err(format!(
                "lfm2moe: a convolution width of {} (expected 2..=64)",
                l.l_cache
            ));
        }
        if l.dense_layers >= s.n_layer {
            return Err(format!(
                "lfm2moe: {} dense layers leave no MoE layer of {}",
                l.dense_layers, s.n_layer
            ));
        }
        if l.dense_layers > 0 && (l.n_ff_dense == 0 || !l.n_ff_dense.is_multiple_of(32)) {
            return Err(format!(
                "lfm2moe: the dense FFN width {} must be a positive multiple of 32",
                l.n_ff_dense
            ));
        }
        if l.attn_layers.iter().any(|&a| a >= s.n_layer) {
            return Err(format!(
                "lfm2moe: attention layers {:?} past the {} layers (use --layers with a preset whose pattern fits, or a generic preset)",
                l.attn_layers, s.n_layer
            ));
        }
        if s.n_ff_shexp != 0 {
            return Err("--shared-ffn: lfm2moe has no shared expert".into());
        }
        Ok(())
    }

    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError> {
        let s = &o.shape;
        let l = lfm2(s).map_err(GenError::Invalid)?;
        let k = |n: &str| format!("lfm2moe.{n}");
        Ok(vec![
            (k("context_length"), Value::U32(s.n_ctx_train)),
            (k("embedding_length"), Value::U32(s.d_model)),
            (k("block_count"), Value::U32(s.n_layer)),
            (k("feed_forward_length"), Value::U32(l.n_ff_dense)),
            (k("attention.head_count"), Value::U32(s.n_head)),
            (
                k("attention.head_count_kv"),
                Value::Array(
                    ValueType::U32,
                    (0..s.n_layer)
                        .map(|i| Value::U32(if l.attends(i) { s.n_head_kv } else { 0 }))
                        .collect(),
                ),
            ),
            (k("rope.freq_base"), Value::F32(s.rope_base)),
            (k("attention.layer_norm_rms_epsilon"), Value::F32(s.rms_eps)),
            (k("expert_count"), Value::U32(s.n_expert)),
            (k("expert_used_count"), Value::U32(s.n_expert_used)),
            (k("expert_feed_forward_length"), Value::U32(s.n_ff_exp)),
            (k("leading_dense_block_count"), Value::U32(l.dense_layers)),
            // LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID.
            (k("expert_gating_func"), Value::U32(2)),
            (k("shortconv.l_cache"), Value::U32(l.l_cache)),
        ])
    }

    fn plan(&self, o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
        plan(o, fallbacks)
    }
}

/// Every tensor of the file: per layer its mixer, then its FFN (llama.cpp's names).
fn plan(o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
    let s = &o.shape;
    let l = lfm2(s).map_err(GenError::Invalid)?;
    let d = s.d_model as u64;
    let nv = o.n_vocab()?;
    let split = s.d_model / 2;
    let kv_dim = (s.n_head_kv * s.head_dim) as u64;
    let ff = s.n_ff_exp as u64;
    let fd = l.n_ff_dense as u64;
    let ne = s.n_expert as u64;
    let taps = l.l_cache as u64;
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
    // llama-quantize counts attn_v tensors in file order: only the attention layers have one.
    let n_attn = l.attn_layers.len() as u32;
    let mut attn_rank = 0;
    for i in 0..s.n_layer {
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        let w = Want::Weight(Some(i));
        push(b("attn_norm"), &[d], f32v, one);
        if l.attends(i) {
            push(b("attn_q"), &[d, d], w, rand(inv(d)));
            push(b("attn_k"), &[d, kv_dim], w, rand(inv(d)));
            push(
                b("attn_v"),
                &[d, kv_dim],
                Want::AttnV {
                    layer: i,
                    rank: attn_rank,
                    of: n_attn,
                },
                rand(inv(d)),
            );
            attn_rank += 1;
            for n in ["attn_q_norm", "attn_k_norm"] {
                push(
                    b(n),
                    &[s.head_dim as u64],
                    f32v,
                    Fill::Const(o.attn_sharpness),
                );
            }
            push(b("attn_output"), &[d, d], w, writes(inv(d), Half::Context));
        } else {
            push(b("shortconv.in_proj"), &[d, 3 * d], w, rand(inv(d)));
            // Unit-variance taps summing `taps` unit products: the sum is about unit scale.
            push(
                b("shortconv.conv"),
                &[taps, d],
                f32v,
                Fill::Rand {
                    std: inv(taps),
                    lo: 0,
                    hi: l.l_cache,
                },
            );
            push(
                b("shortconv.out_proj"),
                &[d, d],
                w,
                writes(inv(d), Half::Context),
            );
        }
        push(b("ffn_norm"), &[d], f32v, one);
        if i < l.dense_layers {
            push(b("ffn_gate"), &[d, fd], w, rand(inv(d)));
            push(b("ffn_up"), &[d, fd], w, rand(inv(d)));
            push(b("ffn_down"), &[fd, d], w, writes(inv(fd), Half::Token));
            continue;
        }
        // The router's logits at twice the generic gain, and a small selection bias. A sigmoid
        // with a bias added after it puts more near-ties at the top-k boundary than a softmax
        // (the bias reorders scores the sigmoid has squeezed together), which two engines'
        // last-bit differences flip: on the tiny Q4_K_M files of seeds 11-13, ours against
        // llama.cpp's, 97.9 % of positions agreed to cos ≥ 0.999 with the generic gain and a
        // bias of std 0.05 (3 × that bias: 96.6 %), 99.25 % on each seed with these.
        let router = match o.router_fill(i) {
            Fill::Router { tok, ctx, split } => Fill::Router {
                tok: 2.0 * tok,
                ctx: 2.0 * ctx,
                split,
            },
            other => other,
        };
        push(b("ffn_gate_inp"), &[d, ne], f32v, router);
        push(
            format!("blk.{i}.exp_probs_b.bias"),
            &[ne],
            f32v,
            Fill::Rand {
                std: 0.01,
                lo: 0,
                hi: s.n_expert,
            },
        );
        push(b("ffn_gate_exps"), &[d, ff, ne], w, rand(inv(d)));
        push(b("ffn_up_exps"), &[d, ff, ne], w, rand(inv(d)));
        push(
            b("ffn_down_exps"),
            &[ff, d, ne],
            w,
            writes(inv(ff), Half::Token),
        );
    }
    push("token_embd_norm.weight".into(), &[d], f32v, one);
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
