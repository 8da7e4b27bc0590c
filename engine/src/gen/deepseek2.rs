//! `gen --arch deepseek2`: the metadata keys and tensors llama.cpp's deepseek2 loader reads
//! (`src/models/deepseek2.cpp`, `load_arch_hparams` / `load_arch_tensors`), in the split MLA
//! form (`attn_k_b`, `attn_v_b`; `attention.key_length_mla` / `value_length_mla` set).
//!
//! Per layer: the query (`attn_q`, or the LoRA `attn_q_a` → `attn_q_a_norm` → `attn_q_b`),
//! the latent projection `attn_kv_a_mqa` and its norm, the per-head absorption matrices
//! `attn_k_b` (`[nope, kv_lora_rank, n_head]`) and `attn_v_b` (`[kv_lora_rank, v_head,
//! n_head]`), `attn_output`; then a dense SiLU-GLU FFN (the first `dense_layers`) or the
//! router, its selection bias where the gating is sigmoid, the stacked experts and the
//! shared experts (`ffn_*_shexp`, `n_shared × n_ff_exp` wide). The file states one KV head
//! whose key is `kv_lora_rank + rope` wide and whose value is `kv_lora_rank` (what llama.cpp
//! sizes its latent cache by). Weights follow the generator's two halves: attention writes the
//! context half, the FFNs the token half.

use super::{
    Fallbacks, Family, Fill, GenError, GenOptions, Half, ModelShape, Planned, Preset, Want,
};
use crate::gguf::{GgmlType, Value};

pub(super) struct Deepseek2;

/// What deepseek2 adds to a [`ModelShape`] (whose `n_head` is the query heads; `head_dim` is
/// stated as `nope + rope`, and `n_head_kv` is 1).
#[derive(Clone, Debug, PartialEq)]
pub struct Deepseek2Shape {
    /// The query LoRA's rank (0: one `attn_q`).
    pub q_lora_rank: u32,
    /// The latent's width.
    pub kv_lora_rank: u32,
    /// A head's non-rotary and rotary q·k parts, and its value width.
    pub nope: u32,
    pub rope: u32,
    pub v_head: u32,
    /// `leading_dense_block_count` and the dense FFN's width (`feed_forward_length`).
    pub dense_layers: u32,
    pub n_ff_dense: u32,
    /// `expert_shared_count`.
    pub n_shared: u32,
    /// Sigmoid gating with a selection bias (`expert_gating_func` 2, Moonlight) instead of a
    /// softmax (DeepSeek-V2).
    pub sigmoid: bool,
    pub weights_norm: bool,
    pub weights_scale: f32,
    /// `rope.scaling.yarn_log_multiplier` as the converter stores it (× 0.1 of the model's
    /// `mscale_all_dim`); used only with YaRN (the shape's `yarn_factor`).
    pub yarn_log_mul: f32,
    /// Grouped selection: `expert_group_count` and `expert_group_used_count` (0: none).
    pub groups: u32,
    pub groups_used: u32,
}

impl Deepseek2Shape {
    /// A generic size's: a query LoRA (as DeepSeek-V2 and Moonlight have) on every size but
    /// tiny-odd (which takes the one `attn_q` of V2-Lite), a latent of `kv_lora_rank`, heads of
    /// 64 + 32 with values of 64, one dense layer, two shared experts, softmax weights not
    /// renormalised (V2-Lite's gating).
    pub fn generic(preset: Preset, d_model: u32) -> Deepseek2Shape {
        let odd = preset == Preset::TinyOdd;
        Deepseek2Shape {
            q_lora_rank: if odd { 0 } else { d_model / 2 },
            kv_lora_rank: if odd { 160 } else { 256 },
            nope: if odd { 48 } else { 64 },
            rope: 32,
            v_head: if odd { 48 } else { 64 },
            dense_layers: 1,
            n_ff_dense: match preset {
                Preset::TinyOdd => 320,
                Preset::Small => 2048,
                _ => 512,
            },
            n_shared: 2,
            sigmoid: false,
            weights_norm: false,
            weights_scale: 1.0,
            yarn_log_mul: 0.0,
            groups: 0,
            groups_used: 0,
        }
    }
}

/// DeepSeek-V2-Lite (its config.json): 27 layers, the first dense (FFN 10944), 64 experts,
/// top-6, 2 shared, d_model 2048, expert FFN 1408, 16 heads, no query LoRA, latent 512, heads
/// of 128 + 64 with values of 128, YaRN ×40 over 4096 positions with `mscale_all_dim` 0.707,
/// softmax weights not renormalised, 163840 positions, RMS eps 1e-6, rope base 10000.
pub(super) fn v2_lite_shape() -> ModelShape {
    ModelShape {
        arch: super::GenArch::Deepseek2,
        n_layer: 27,
        n_expert: 64,
        n_expert_used: 6,
        d_model: 2048,
        n_ff_exp: 1408,
        n_ff_shexp: 0,
        n_head: 16,
        n_head_kv: 1,
        head_dim: 192,
        n_ctx_train: 163_840,
        rope_base: 10_000.0,
        rms_eps: 1e-6,
        tie_output: false,
        gemma: None,
        lfm2: None,
        qwen35: None,
        deepseek2: Some(Deepseek2Shape {
            q_lora_rank: 0,
            kv_lora_rank: 512,
            nope: 128,
            rope: 64,
            v_head: 128,
            dense_layers: 1,
            n_ff_dense: 10944,
            n_shared: 2,
            sigmoid: false,
            weights_norm: false,
            weights_scale: 1.0,
            yarn_log_mul: 0.0707,
            groups: 0,
            groups_used: 0,
        }),
        bailing: None,
        deepseek4: None,
        n_swa: 0,
        yarn_factor: 40.0,
        yarn_orig_ctx: 4096,
    }
}

/// Moonlight-16B-A3B (moonshotai's config.json): as V2-Lite (27 layers, one `attn_q`: llama.cpp
/// reads a 27-layer deepseek2 file as a Lite one, with no query LoRA), 64 experts top-6, 2
/// shared, sigmoid gating with a selection bias, renormalised, × 2.446, no rope scaling, 8192
/// positions, a 163840-token vocabulary (ours: whatever `--vocab` gives).
pub(super) fn moonlight_shape() -> ModelShape {
    let mut s = v2_lite_shape();
    s.n_ctx_train = 8192;
    s.rope_base = 50_000.0;
    s.yarn_factor = 0.0;
    s.yarn_orig_ctx = 0;
    s.rms_eps = 1e-5;
    let d = s.deepseek2.as_mut().expect("v2-lite shape");
    d.n_ff_dense = 11264;
    d.sigmoid = true;
    d.weights_norm = true;
    d.weights_scale = 2.446;
    d.yarn_log_mul = 0.0;
    s
}

/// DeepSeek-V2 (its config.json): 60 layers, the first dense (FFN 12288), 160 experts, top-6 in
/// 8 groups of which 3 are selectable, 2 shared, d_model 5120, expert FFN 1536, 128 heads with a
/// query LoRA of 1536 over V2-Lite's latent attention, softmax weights not renormalised, × 16;
/// YaRN as V2-Lite. (Its own top-k takes a group's best score; llama.cpp, which this follows,
/// the sum of its two best.)
pub(super) fn v2_shape() -> ModelShape {
    let mut s = v2_lite_shape();
    s.n_layer = 60;
    s.n_expert = 160;
    s.d_model = 5120;
    s.n_ff_exp = 1536;
    s.n_head = 128;
    let d = s.deepseek2.as_mut().expect("v2-lite shape");
    d.q_lora_rank = 1536;
    d.n_ff_dense = 12288;
    d.weights_scale = 16.0;
    d.groups = 8;
    d.groups_used = 3;
    s
}

fn ds(s: &ModelShape) -> Result<&Deepseek2Shape, String> {
    s.deepseek2
        .as_ref()
        .ok_or_else(|| "deepseek2 needs its attention shape (a deepseek2 preset)".to_string())
}

impl Family for Deepseek2 {
    fn generic(&self, preset: Preset, s: &mut ModelShape) {
        let x = Deepseek2Shape::generic(preset, s.d_model);
        s.n_head_kv = 1;
        s.head_dim = x.nope + x.rope;
        s.deepseek2 = Some(x);
    }

    fn validate(&self, s: &ModelShape) -> Result<(), String> {
        let x = ds(s)?;
        if x.rope == 0 || x.rope % 2 != 0 || x.nope == 0 || x.v_head == 0 || x.kv_lora_rank == 0 {
            return Err(format!(
                "deepseek2: nope {}, rope {} (even), value {} and latent {} must be positive",
                x.nope, x.rope, x.v_head, x.kv_lora_rank
            ));
        }
        if x.dense_layers >= s.n_layer {
            return Err(format!(
                "deepseek2: {} dense layers leave no MoE layer of {}",
                x.dense_layers, s.n_layer
            ));
        }
        if x.dense_layers > 0 && (x.n_ff_dense == 0 || !x.n_ff_dense.is_multiple_of(32)) {
            return Err(format!(
                "deepseek2: the dense FFN width {} must be a positive multiple of 32",
                x.n_ff_dense
            ));
        }
        if x.groups > 1
            && (!s.n_expert.is_multiple_of(x.groups)
                || s.n_expert / x.groups < 2
                || x.groups_used == 0
                || x.groups_used >= x.groups
                || s.n_expert_used > x.groups_used * (s.n_expert / x.groups))
        {
            return Err(format!(
                "deepseek2: {} experts in {} groups of which {} selectable cannot give top-{}",
                s.n_expert, x.groups, x.groups_used, s.n_expert_used
            ));
        }
        if x.n_shared == 0 {
            return Err("deepseek2: at least one shared expert".into());
        }
        if s.n_ff_shexp != 0 {
            return Err(
                "--shared-ffn: deepseek2's shared experts are expert_shared_count × the expert FFN"
                    .into(),
            );
        }
        // llama.cpp takes 26/27-layer files for V2-Lite and then never reads q_lora_rank.
        if x.q_lora_rank > 0 && (s.n_layer == 26 || s.n_layer == 27) {
            return Err(format!(
                "deepseek2: llama.cpp reads a {}-layer file as V2-Lite, which has no query LoRA",
                s.n_layer
            ));
        }
        Ok(())
    }

    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError> {
        let s = &o.shape;
        let x = ds(s).map_err(GenError::Invalid)?;
        let k = |n: &str| format!("deepseek2.{n}");
        let mut m = vec![
            (k("context_length"), Value::U32(s.n_ctx_train)),
            (k("embedding_length"), Value::U32(s.d_model)),
            (k("block_count"), Value::U32(s.n_layer)),
            (k("feed_forward_length"), Value::U32(x.n_ff_dense)),
            (k("attention.head_count"), Value::U32(s.n_head)),
            (k("attention.head_count_kv"), Value::U32(1)),
            (
                k("attention.key_length"),
                Value::U32(x.kv_lora_rank + x.rope),
            ),
            (k("attention.value_length"), Value::U32(x.kv_lora_rank)),
            (k("attention.key_length_mla"), Value::U32(x.nope + x.rope)),
            (k("attention.value_length_mla"), Value::U32(x.v_head)),
            (k("attention.q_lora_rank"), Value::U32(x.q_lora_rank)),
            (k("attention.kv_lora_rank"), Value::U32(x.kv_lora_rank)),
            (k("rope.dimension_count"), Value::U32(x.rope)),
            (k("rope.freq_base"), Value::F32(s.rope_base)),
            (k("attention.layer_norm_rms_epsilon"), Value::F32(s.rms_eps)),
            (k("expert_count"), Value::U32(s.n_expert)),
            (k("expert_used_count"), Value::U32(s.n_expert_used)),
            (k("expert_feed_forward_length"), Value::U32(s.n_ff_exp)),
            (k("expert_shared_count"), Value::U32(x.n_shared)),
            (k("leading_dense_block_count"), Value::U32(x.dense_layers)),
            (k("expert_weights_scale"), Value::F32(x.weights_scale)),
            (k("expert_weights_norm"), Value::Bool(x.weights_norm)),
            (
                k("expert_gating_func"),
                Value::U32(if x.sigmoid { 2 } else { 1 }),
            ),
        ];
        if x.groups > 1 {
            m.push((k("expert_group_count"), Value::U32(x.groups)));
            m.push((k("expert_group_used_count"), Value::U32(x.groups_used)));
        }
        if s.yarn_factor > 0.0 {
            m.extend([
                (k("rope.scaling.type"), Value::String("yarn".into())),
                (k("rope.scaling.factor"), Value::F32(s.yarn_factor)),
                (
                    k("rope.scaling.original_context_length"),
                    Value::U32(s.yarn_orig_ctx),
                ),
                (
                    k("rope.scaling.yarn_log_multiplier"),
                    Value::F32(x.yarn_log_mul),
                ),
            ]);
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
    let x = ds(s).map_err(GenError::Invalid)?;
    let d = s.d_model as u64;
    let nv = o.n_vocab()?;
    let model = o.mix_model();
    let mut out = Vec::new();
    let mut push = |name: String, dims: &[u64], want: Want, fill: Fill| {
        out.push(o.planned(&model, name, dims, want, fill, fallbacks));
    };
    let f32v = Want::Keep(GgmlType::F32);
    let rand = |std: f32, lo: u32, hi: u32| Fill::Rand { std, lo, hi };
    push(
        "token_embd.weight".into(),
        &[d, nv],
        Want::Weight(None),
        rand(1.0, 0, s.d_model / 2),
    );
    for i in 0..s.n_layer {
        push(
            format!("blk.{i}.attn_norm.weight"),
            &[d],
            f32v,
            Fill::Const(1.0),
        );
        mla_tensors(&mut push, o, i, x, false);
        ffn_tensors(&mut push, o, i, x, x.sigmoid);
    }
    push("output_norm.weight".into(), &[d], f32v, Fill::Const(1.0));
    if !s.tie_output {
        push(
            "output.weight".into(),
            &[d, nv],
            Want::Weight(None),
            rand(1.0 / (d as f32).sqrt(), 0, s.d_model),
        );
    }
    Ok(out)
}

/// Where a plan sends a tensor: its name, dims, wanted type and fill.
pub(super) type Push<'a> = dyn FnMut(String, &[u64], Want, Fill) + 'a;

/// Layer `i`'s latent attention after its `attn_norm` (deepseek2's, and bailingmoe3's MLA
/// layers with their per-head output gate `attn_gate` where `gated`), writing the context half.
pub(super) fn mla_tensors(
    push: &mut Push<'_>,
    o: &GenOptions,
    i: u32,
    x: &Deepseek2Shape,
    gated: bool,
) {
    let s = &o.shape;
    let b = |n: &str| format!("blk.{i}.{n}.weight");
    let (d, nh) = (s.d_model as u64, s.n_head as u64);
    let (r, rope, nope, vh) = (
        x.kv_lora_rank as u64,
        x.rope as u64,
        x.nope as u64,
        x.v_head as u64,
    );
    let qa = x.q_lora_rank as u64;
    let k_mla = nope + rope;
    let inv = |n: u64| 1.0 / (n as f32).sqrt();
    let rand = |std: f32, width: u32| Fill::Rand {
        std,
        lo: 0,
        hi: width,
    };
    let (w, f32v) = (Want::Weight(Some(i)), Want::Keep(GgmlType::F32));
    if qa > 0 {
        push(b("attn_q_a_norm"), &[qa], f32v, Fill::Const(1.0));
    }
    // The latent is normed: its gain is the attention's sharpness on the latent side, as
    // the absorption matrix's is on the query side.
    push(
        b("attn_kv_a_norm"),
        &[r],
        f32v,
        Fill::Const(o.attn_sharpness.sqrt()),
    );
    if qa > 0 {
        push(b("attn_q_a"), &[d, qa], w, rand(inv(d), s.d_model));
        push(
            b("attn_q_b"),
            &[qa, nh * k_mla],
            w,
            rand(inv(qa), x.q_lora_rank),
        );
    } else {
        push(b("attn_q"), &[d, nh * k_mla], w, rand(inv(d), s.d_model));
    }
    push(
        b("attn_kv_a_mqa"),
        &[d, r + rope],
        w,
        rand(inv(d), s.d_model),
    );
    push(
        b("attn_k_b"),
        &[nope, r, nh],
        w,
        rand(inv(nope) * o.attn_sharpness.sqrt(), x.nope),
    );
    push(b("attn_v_b"), &[r, vh, nh], w, rand(inv(r), x.kv_lora_rank));
    if gated {
        push(b("attn_gate"), &[d, nh], w, rand(inv(d), s.d_model));
    }
    push(
        b("attn_output"),
        &[nh * vh, d],
        w,
        Fill::RandRows {
            std: inv(nh * vh),
            half: Half::Context,
            split: s.d_model / 2,
        },
    );
}

/// Layer `i`'s `ffn_norm` and FFN (deepseek2's, bailingmoe3's), writing the token half: a
/// dense SiLU-GLU in the first `dense_layers`, else the router (its selection bias where
/// `biased`), the stacked experts and the shared experts.
pub(super) fn ffn_tensors(
    push: &mut Push<'_>,
    o: &GenOptions,
    i: u32,
    x: &Deepseek2Shape,
    biased: bool,
) {
    let s = &o.shape;
    let b = |n: &str| format!("blk.{i}.{n}.weight");
    let d = s.d_model as u64;
    let ff = s.n_ff_exp as u64;
    let fs = ff * x.n_shared as u64;
    let fd = x.n_ff_dense as u64;
    let ne = s.n_expert as u64;
    let inv = |n: u64| 1.0 / (n as f32).sqrt();
    let rand = |std: f32, width: u32| Fill::Rand {
        std,
        lo: 0,
        hi: width,
    };
    let writes = |std: f32| Fill::RandRows {
        std,
        half: Half::Token,
        split: s.d_model / 2,
    };
    let (w, f32v) = (Want::Weight(Some(i)), Want::Keep(GgmlType::F32));
    push(b("ffn_norm"), &[d], f32v, Fill::Const(1.0));
    if i < x.dense_layers {
        push(b("ffn_gate"), &[d, fd], w, rand(inv(d), s.d_model));
        push(b("ffn_down"), &[fd, d], w, writes(inv(fd)));
        push(b("ffn_up"), &[d, fd], w, rand(inv(d), s.d_model));
        return;
    }
    push(b("ffn_gate_inp"), &[d, ne], f32v, o.router_fill(i));
    if biased {
        push(
            format!("blk.{i}.exp_probs_b.bias"),
            &[ne],
            f32v,
            rand(0.01, s.n_expert),
        );
    }
    push(b("ffn_gate_exps"), &[d, ff, ne], w, rand(inv(d), s.d_model));
    push(b("ffn_up_exps"), &[d, ff, ne], w, rand(inv(d), s.d_model));
    push(b("ffn_down_exps"), &[ff, d, ne], w, writes(inv(ff)));
    push(b("ffn_gate_shexp"), &[d, fs], w, rand(inv(d), s.d_model));
    push(b("ffn_up_shexp"), &[d, fs], w, rand(inv(d), s.d_model));
    push(b("ffn_down_shexp"), &[fs, d], w, writes(inv(fs)));
}
