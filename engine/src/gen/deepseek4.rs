//! `gen --arch deepseek4`: the metadata keys and tensors llama.cpp's DeepSeek-V4 loader reads
//! (`src/models/deepseek4.cpp`, `load_arch_hparams` / `load_arch_tensors`; the map is
//! docs/architectures.md, "deepseek4").
//!
//! The root: `token_embd`, `output_norm`, `output` and the hyper-connection head
//! (`output_hc_fn` `[hc·E, hc]`, `output_hc_base` `[hc]`, `output_hc_scale` `[1]`). Per layer:
//! `attn_norm`, the per-head `attn_sinks`, the query LoRA (`attn_q_a` → `attn_q_a_norm` →
//! `attn_q_b`), the single key-and-value head `attn_kv` and its norm, the grouped low-rank
//! output (`attn_output_a` stored `[H·d/G, R_o·G]`, `attn_output_b` `[G·R_o, E]`), the two
//! hyper-connection mixes (`hc_attn_*`, `hc_ffn_*`: `fn` `[hc·E, (2+hc)·hc]`, `base`, `scale`
//! `[3]`); on compressed layers (ratio 4 or 128) the KV compressor `attn_compressor_{kv,gate,
//! ape,norm}`, and on ratio-4 layers also the indexer (`indexer.proj`, `indexer.attn_q_b`) and
//! its own compressor; then the router, the hash table `ffn_gate_tid2eid` (I32 `[K, n_vocab]`,
//! the first `hash_layers`) or the selection bias `exp_probs_b`, `ffn_norm`, the stacked
//! experts and the shared expert. No MTP block is written.
//!
//! Weights follow the generator's two halves: attention writes the context half (its
//! `attn_output_b`), the FFNs the token half. The hyper-connection mixes act per stream,
//! never across dimensions, so they keep the halves apart; their `fn` is small so the 24
//! mixes stay moderate, `scale` near 1 and `base` of std 0.5 (pre/post gates and a Sinkhorn
//! mix far from saturation).

use super::{
    Fallbacks, Family, Fill, GenArch, GenError, GenOptions, Half, ModelShape, Planned, Preset, Want,
};
use crate::gguf::{GgmlType, Value, ValueType};

pub(super) struct Deepseek4;

/// What deepseek4 adds to a [`ModelShape`], whose `n_head` is H, `head_dim` d (key and value
/// alike), `n_head_kv` 1, `n_swa` the window and `yarn_*` the compressed layers' YaRN.
#[derive(Clone, Debug, PartialEq)]
pub struct Deepseek4Shape {
    /// r: the rotated tail of every head (`rope.dimension_count`), the indexer's too.
    pub rope: u32,
    /// `attention.q_lora_rank`.
    pub q_lora_rank: u32,
    /// G and R_o: `attention.output_group_count` and `output_lora_rank`.
    pub o_groups: u32,
    pub o_lora_rank: u32,
    /// `attention.indexer.head_count`, `key_length`, `top_k`.
    pub indexer_heads: u32,
    pub indexer_dim: u32,
    pub indexer_top_k: u32,
    /// `attention.compress_ratios`: the first `window_layers` layers 0 (window only), then
    /// 4 (CSA with the indexer) and 128 (HCA) by turns, as DeepSeek-V4-Flash.
    pub window_layers: u32,
    /// `attention.compress_rope_freq_base`: the compressed layers' rotary base.
    pub compress_rope_base: f32,
    /// `hash_layer_count`: the first layers route by token id (`ffn_gate_tid2eid`).
    pub hash_layers: u32,
    /// `hyper_connection.count`, `sinkhorn_iterations`, `epsilon`.
    pub hc: u32,
    pub sinkhorn_iters: u32,
    pub hc_eps: f32,
    /// `expert_shared_count` (the shared expert is this × the expert FFN wide).
    pub n_shared: u32,
    pub weights_norm: bool,
    pub weights_scale: f32,
    /// `swiglu_clamp_exp` on every layer, and `swiglu_clamp_shexp` (`None`: not written, so
    /// llama.cpp takes the experts' limit).
    pub swiglu_exp: f32,
    pub swiglu_shexp: Option<f32>,
}

impl Deepseek4Shape {
    /// The compression ratio of layer `i`.
    pub fn ratio(&self, i: u32) -> u32 {
        if i < self.window_layers {
            0
        } else if (i - self.window_layers).is_multiple_of(2) {
            4
        } else {
            128
        }
    }

    /// A generic size's (tiny, tiny-odd, small). tiny: heads of 64 with 16 rotated, a query
    /// LoRA of 128, two output groups of rank 32, an indexer of two heads of 128 keeping 4
    /// rows, ratios 0, 4, 128, 4, one hash layer, SwiGLUs limited to ±1. tiny-odd: none of
    /// its rows a multiple of 256 (heads of 96 with 32 rotated, LoRA 160, three groups, an
    /// indexer of three heads of 64), every layer compressed, two hash layers, the shared
    /// expert's own limit 0.8. small: heads of 128 with 64 rotated and Flash's layer pattern
    /// and limits.
    ///
    /// The indexer's heads are a multiple of 64 wide: llama.cpp rotates the indexer's queries
    /// and keys by a Hadamard matrix of 64 or more, and narrower heads fail its graph (a
    /// reshape asserts). They are not as wide as the attention's either: where the two widths
    /// are equal llama.cpp rotates the attention's keys too (no change in exact arithmetic,
    /// but DeepSeek-V4-Flash's 512 and 128 never do). There are 8 of them: a block's indexer
    /// score `Σ_h w_h·ReLU(q_h·k)` is exactly 0 when every head's ReLU is, and with 2 heads a
    /// quarter of the selections tie at 0, which llama.cpp's `std::partial_sort` breaks in an
    /// order of its heap's (docs/architectures.md, deepseek4).
    pub fn generic(preset: Preset) -> Deepseek4Shape {
        let tiny = Deepseek4Shape {
            rope: 16,
            q_lora_rank: 128,
            o_groups: 2,
            o_lora_rank: 32,
            indexer_heads: 8,
            indexer_dim: 128,
            indexer_top_k: 4,
            window_layers: 1,
            compress_rope_base: 160_000.0,
            hash_layers: 1,
            hc: 4,
            sinkhorn_iters: 20,
            hc_eps: 1e-6,
            n_shared: 1,
            weights_norm: true,
            weights_scale: 1.5,
            swiglu_exp: 1.0,
            swiglu_shexp: None,
        };
        match preset {
            Preset::TinyOdd => Deepseek4Shape {
                rope: 32,
                q_lora_rank: 160,
                o_groups: 3,
                o_lora_rank: 32,
                indexer_heads: 8,
                indexer_dim: 64,
                indexer_top_k: 3,
                window_layers: 0,
                hash_layers: 2,
                weights_scale: 2.5,
                swiglu_shexp: Some(0.8),
                ..tiny
            },
            Preset::Small => Deepseek4Shape {
                rope: 64,
                q_lora_rank: 512,
                o_groups: 4,
                o_lora_rank: 128,
                indexer_heads: 8,
                indexer_dim: 128,
                indexer_top_k: 64,
                window_layers: 2,
                hash_layers: 3,
                swiglu_exp: 10.0,
                swiglu_shexp: Some(10.0),
                ..tiny
            },
            _ => tiny,
        }
    }
}

/// DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash's config.json): 43 layers (the first two
/// window-only, then ratio 4 and 128 by turns, the last 4), hash routing on the first 3, 256
/// experts top-6 with one shared, FFN 2048, d_model 4096, 64 heads of 512 with 64 rotated, a
/// query LoRA of 1024, 8 output groups of rank 1024, a window of 128, an indexer of 64 heads of
/// 128 keeping 512 rows, 4 hyper-connection streams (20 Sinkhorn iterations, ε 1e-6),
/// sqrt-softplus weights renormalised × 1.5, SwiGLUs limited to ±10, rope base 10000 (160000
/// on compressed layers), YaRN ×16 over 65536 positions, 1048576 positions, RMS eps 1e-6. Its
/// MTP block is not written.
pub(super) fn v4_flash_shape() -> ModelShape {
    ModelShape {
        arch: GenArch::Deepseek4,
        n_layer: 43,
        n_expert: 256,
        n_expert_used: 6,
        d_model: 4096,
        n_ff_exp: 2048,
        n_ff_shexp: 0,
        n_head: 64,
        n_head_kv: 1,
        head_dim: 512,
        n_ctx_train: 1_048_576,
        rope_base: 10_000.0,
        rms_eps: 1e-6,
        tie_output: false,
        gemma: None,
        lfm2: None,
        qwen35: None,
        deepseek2: None,
        bailing: None,
        deepseek4: Some(Deepseek4Shape {
            rope: 64,
            q_lora_rank: 1024,
            o_groups: 8,
            o_lora_rank: 1024,
            indexer_heads: 64,
            indexer_dim: 128,
            indexer_top_k: 512,
            window_layers: 2,
            compress_rope_base: 160_000.0,
            hash_layers: 3,
            hc: 4,
            sinkhorn_iters: 20,
            hc_eps: 1e-6,
            n_shared: 1,
            weights_norm: true,
            weights_scale: 1.5,
            swiglu_exp: 10.0,
            swiglu_shexp: Some(10.0),
        }),
        n_swa: 128,
        yarn_factor: 16.0,
        yarn_orig_ctx: 65_536,
    }
}

fn ds(s: &ModelShape) -> Result<&Deepseek4Shape, String> {
    s.deepseek4
        .as_ref()
        .ok_or_else(|| "deepseek4 needs its attention shape (a deepseek4 preset)".to_string())
}

impl Family for Deepseek4 {
    fn generic(&self, preset: Preset, s: &mut ModelShape) {
        s.n_head_kv = 1;
        s.rope_base = 10_000.0;
        match preset {
            Preset::TinyOdd => {
                s.head_dim = 96;
                s.n_swa = 24;
                s.yarn_factor = 16.0;
                s.yarn_orig_ctx = 512;
                s.n_ctx_train = 8192;
            }
            Preset::Small => {
                s.head_dim = 128;
                s.n_swa = 128;
                s.yarn_factor = 16.0;
                s.yarn_orig_ctx = 4096;
                s.n_ctx_train = 65_536;
            }
            _ => {
                s.n_ff_exp = 256;
                s.head_dim = 64;
                s.n_swa = 16;
                s.yarn_factor = 4.0;
                s.yarn_orig_ctx = 1024;
                s.n_ctx_train = 4096;
            }
        }
        s.deepseek4 = Some(Deepseek4Shape::generic(preset));
    }

    fn validate(&self, s: &ModelShape) -> Result<(), String> {
        let x = ds(s)?;
        let d = s.head_dim;
        if s.n_head_kv != 1 {
            return Err(format!(
                "--kv-heads {}: deepseek4 has one key-and-value head",
                s.n_head_kv
            ));
        }
        if x.rope == 0 || !x.rope.is_multiple_of(2) || x.rope > d {
            return Err(format!(
                "deepseek4: the rotated part {} must be even, positive and at most the head's {d}",
                x.rope
            ));
        }
        if x.o_groups == 0 || !s.n_head.is_multiple_of(x.o_groups) {
            return Err(format!(
                "deepseek4: {} heads do not split into {} output groups (llama.cpp asserts H % G == 0)",
                s.n_head, x.o_groups
            ));
        }
        let group_in = s.n_head / x.o_groups * d;
        for (what, n) in [
            ("the query LoRA's rank", x.q_lora_rank),
            (
                "an output group's width (heads / groups × head dim)",
                group_in,
            ),
            (
                "the output LoRA (groups × rank)",
                x.o_groups * x.o_lora_rank,
            ),
        ] {
            if n == 0 || !n.is_multiple_of(32) {
                return Err(format!(
                    "deepseek4: {what} {n} must be a positive multiple of 32 (the smallest quant block)"
                ));
            }
        }
        if !d.is_multiple_of(32) {
            return Err(format!(
                "--head-dim {d}: deepseek4's heads must be a multiple of 32 wide (the compressors' rows)"
            ));
        }
        if x.indexer_heads == 0
            || x.indexer_top_k == 0
            || x.indexer_dim < 64
            || !x.indexer_dim.is_multiple_of(64)
            || x.indexer_dim < x.rope
        {
            return Err(format!(
                "deepseek4: indexer heads {} of {} keeping {}: llama.cpp rotates the indexer by a \
                 Hadamard matrix of 64 or more, so its heads must be a multiple of 64 wide (and at \
                 least the {} rotated), with at least one head and one row kept",
                x.indexer_heads, x.indexer_dim, x.indexer_top_k, x.rope
            ));
        }
        if x.hc != 4 {
            return Err(format!(
                "deepseek4: {} hyper-connection streams; llama.cpp's graph asserts 4",
                x.hc
            ));
        }
        if x.sinkhorn_iters == 0 || !(x.hc_eps.is_finite() && x.hc_eps > 0.0) {
            return Err(format!(
                "deepseek4: Sinkhorn iterations {} (≥ 1) and epsilon {} (> 0)",
                x.sinkhorn_iters, x.hc_eps
            ));
        }
        // Without a ratio-4 layer llama.cpp's indexer cache holds no layer, its head width is
        // 0, and `build_input_k_rot` doubles its rotation size until it divides by zero
        // (SIGFPE while reserving the first graph).
        if !(0..s.n_layer).any(|i| x.ratio(i) == 4) {
            return Err(format!(
                "deepseek4: {} layers with {} window-only leave no layer compressed by 4, which \
                 llama.cpp cannot run (its indexer cache would have no layer)",
                s.n_layer, x.window_layers
            ));
        }
        if x.hash_layers > s.n_layer {
            return Err(format!(
                "deepseek4: {} hash layers of {} layers",
                x.hash_layers, s.n_layer
            ));
        }
        if s.n_layer > 512 {
            return Err(format!(
                "--layers {}: llama.cpp holds at most 512 compression ratios",
                s.n_layer
            ));
        }
        if s.n_swa == 0 {
            return Err("deepseek4: every layer attends in a window; it must be positive".into());
        }
        if x.n_shared == 0 {
            return Err("deepseek4: at least one shared expert".into());
        }
        if s.n_ff_shexp != 0 {
            return Err(
                "--shared-ffn: deepseek4's shared expert is expert_shared_count × the expert FFN"
                    .into(),
            );
        }
        if s.tie_output {
            return Err("--tie-output: llama.cpp requires deepseek4's output.weight".into());
        }
        let at_least = |v: f32, lo: f32| v.is_finite() && v >= lo;
        let limits_ok = [Some(x.swiglu_exp), x.swiglu_shexp]
            .into_iter()
            .flatten()
            .all(|l| at_least(l, 0.0));
        let sound = limits_ok
            && x.weights_scale.is_finite()
            && at_least(x.compress_rope_base, f32::MIN_POSITIVE)
            && at_least(s.yarn_factor, 0.0);
        if !sound {
            return Err(format!(
                "deepseek4: SwiGLU limits {:?} / {:?} (≥ 0), weights scale {}, compressed rope base \
                 {} (> 0) and YaRN factor {} must be finite",
                x.swiglu_exp,
                x.swiglu_shexp,
                x.weights_scale,
                x.compress_rope_base,
                s.yarn_factor
            ));
        }
        if s.yarn_factor > 0.0 && s.yarn_orig_ctx == 0 {
            return Err("deepseek4: YaRN needs its original context length".into());
        }
        Ok(())
    }

    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError> {
        let s = &o.shape;
        let x = ds(s).map_err(GenError::Invalid)?;
        let k = |n: &str| format!("deepseek4.{n}");
        let per_layer =
            |v: f32| Value::Array(ValueType::F32, vec![Value::F32(v); s.n_layer as usize]);
        let ratios = (0..s.n_layer).map(|i| Value::U32(x.ratio(i))).collect();
        let mut m = vec![
            (k("context_length"), Value::U32(s.n_ctx_train)),
            (k("embedding_length"), Value::U32(s.d_model)),
            (k("block_count"), Value::U32(s.n_layer)),
            (k("attention.head_count"), Value::U32(s.n_head)),
            (k("attention.head_count_kv"), Value::U32(1)),
            (k("rope.freq_base"), Value::F32(s.rope_base)),
            (k("attention.layer_norm_rms_epsilon"), Value::F32(s.rms_eps)),
            (k("expert_count"), Value::U32(s.n_expert)),
            (k("expert_used_count"), Value::U32(s.n_expert_used)),
            (k("expert_gating_func"), Value::U32(4)),
            (k("attention.key_length"), Value::U32(s.head_dim)),
            (k("attention.value_length"), Value::U32(s.head_dim)),
            (k("rope.dimension_count"), Value::U32(x.rope)),
            (k("attention.q_lora_rank"), Value::U32(x.q_lora_rank)),
            (k("attention.sliding_window"), Value::U32(s.n_swa)),
            (k("expert_feed_forward_length"), Value::U32(s.n_ff_exp)),
            (k("expert_shared_count"), Value::U32(x.n_shared)),
            (k("expert_weights_scale"), Value::F32(x.weights_scale)),
            (k("expert_weights_norm"), Value::Bool(x.weights_norm)),
            (k("swiglu_clamp_exp"), per_layer(x.swiglu_exp)),
        ];
        if let Some(l) = x.swiglu_shexp {
            m.push((k("swiglu_clamp_shexp"), per_layer(l)));
        }
        m.extend([
            (
                k("attention.indexer.head_count"),
                Value::U32(x.indexer_heads),
            ),
            (k("attention.indexer.key_length"), Value::U32(x.indexer_dim)),
            (k("attention.indexer.top_k"), Value::U32(x.indexer_top_k)),
            (k("attention.output_group_count"), Value::U32(x.o_groups)),
            (k("attention.output_lora_rank"), Value::U32(x.o_lora_rank)),
            (
                k("attention.compress_ratios"),
                Value::Array(ValueType::U32, ratios),
            ),
            (
                k("attention.compress_rope_freq_base"),
                Value::F32(x.compress_rope_base),
            ),
            (k("hyper_connection.count"), Value::U32(x.hc)),
            (
                k("hyper_connection.sinkhorn_iterations"),
                Value::U32(x.sinkhorn_iters),
            ),
            (k("hyper_connection.epsilon"), Value::F32(x.hc_eps)),
            (k("hash_layer_count"), Value::U32(x.hash_layers)),
            // As the converter writes it; llama.cpp's loader sets hc·E itself.
            (k("embedding_length_out"), Value::U32(x.hc * s.d_model)),
        ]);
        if s.yarn_factor > 0.0 {
            // The converter's YaRN keys. llama.cpp's deepseek4 reads the first three and
            // takes its defaults for the betas, which are DeepSeek-V4's 32 and 1.
            m.extend([
                (k("rope.scaling.type"), Value::String("yarn".into())),
                (k("rope.scaling.factor"), Value::F32(s.yarn_factor)),
                (
                    k("rope.scaling.original_context_length"),
                    Value::U32(s.yarn_orig_ctx),
                ),
                (k("rope.scaling.yarn_beta_fast"), Value::F32(32.0)),
                (k("rope.scaling.yarn_beta_slow"), Value::F32(1.0)),
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
    let nv = o.n_vocab()?;
    let (d, nh, hd) = (s.d_model as u64, s.n_head as u64, s.head_dim as u64);
    let (qr, g, ro) = (
        x.q_lora_rank as u64,
        x.o_groups as u64,
        x.o_lora_rank as u64,
    );
    let (hi, di) = (x.indexer_heads as u64, x.indexer_dim as u64);
    let hc = x.hc as u64;
    let mix = (2 + hc) * hc;
    let (ff, fs, ne, k) = (
        s.n_ff_exp as u64,
        (s.n_ff_exp * x.n_shared) as u64,
        s.n_expert as u64,
        s.n_expert_used as u64,
    );
    let model = o.mix_model();
    let mut out = Vec::new();
    let mut push = |name: String, dims: &[u64], want: Want, fill: Fill| {
        out.push(o.planned(&model, name, dims, want, fill, fallbacks));
    };
    let f32v = Want::Keep(GgmlType::F32);
    let inv = |n: u64| 1.0 / (n as f32).sqrt();
    let rand = |std: f32, width: u64| Fill::Rand {
        std,
        lo: 0,
        hi: width as u32,
    };
    let one = Fill::Const(1.0);
    // The latent keys' gain is the attention's sharpness (queries are normed per head with no
    // weight): scores of std ≈ √sharpness, a near-uniform running mean at the default.
    let kv_gain = Fill::Const(o.attn_sharpness.sqrt());
    // A hyper-connection mix: 24 (or hc for the head) values of std 0.5 from the normed
    // streams, scaled near 1 and shifted by a base of std 0.5.
    let hc_fn = rand(0.5 * inv(hc * d), hc * d);
    let hc_base = |n: u64| rand(0.5, n);
    let hc_scale = Fill::Uniform { lo: 0.5, hi: 1.5 };
    let writes = |std: f32, half: Half| Fill::RandRows {
        std,
        half,
        split: s.d_model / 2,
    };

    push(
        "token_embd.weight".into(),
        &[d, nv],
        Want::Weight(None),
        rand(1.0, d / 2),
    );
    push("output_norm.weight".into(), &[d], f32v, one);
    push(
        "output.weight".into(),
        &[d, nv],
        Want::Weight(None),
        rand(inv(d), d),
    );
    push(
        "output_hc_fn.weight".into(),
        &[hc * d, hc],
        Want::Weight(None),
        hc_fn,
    );
    push("output_hc_base.weight".into(), &[hc], f32v, hc_base(hc));
    push("output_hc_scale.weight".into(), &[1], f32v, hc_scale);
    for i in 0..s.n_layer {
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        let w = Want::Weight(Some(i));
        push(b("attn_norm"), &[d], f32v, one);
        push(b("attn_sinks"), &[nh], f32v, rand(1.0, nh));
        push(b("attn_q_a"), &[d, qr], w, rand(inv(d), d));
        push(b("attn_q_a_norm"), &[qr], f32v, one);
        push(b("attn_q_b"), &[qr, nh * hd], w, rand(inv(qr), qr));
        push(b("attn_kv"), &[d, hd], w, rand(inv(d), d));
        push(b("attn_kv_a_norm"), &[hd], f32v, kv_gain);
        let group_in = nh * hd / g;
        push(
            b("attn_output_a"),
            &[group_in, ro * g],
            w,
            rand(inv(group_in), group_in),
        );
        push(
            b("attn_output_b"),
            &[g * ro, d],
            w,
            writes(inv(g * ro), Half::Context),
        );
        for sub in ["attn", "ffn"] {
            push(b(&format!("hc_{sub}_fn")), &[hc * d, mix], w, hc_fn);
            push(b(&format!("hc_{sub}_base")), &[mix], f32v, hc_base(mix));
            push(b(&format!("hc_{sub}_scale")), &[3], f32v, hc_scale);
        }
        let ratio = x.ratio(i) as u64;
        if ratio != 0 {
            let coff = if ratio == 4 { 2 } else { 1 };
            push(b("attn_compressor_kv"), &[d, coff * hd], w, rand(inv(d), d));
            push(
                b("attn_compressor_gate"),
                &[d, coff * hd],
                w,
                rand(inv(d), d),
            );
            push(
                b("attn_compressor_ape"),
                &[coff * hd, ratio],
                w,
                rand(0.5, coff * hd),
            );
            push(b("attn_compressor_norm"), &[hd], f32v, kv_gain);
            if ratio == 4 {
                push(b("indexer.proj"), &[d, hi], w, rand(inv(d), d));
                push(b("indexer.attn_q_b"), &[qr, hi * di], w, rand(inv(qr), qr));
                push(b("indexer_compressor_kv"), &[d, 2 * di], w, rand(inv(d), d));
                push(
                    b("indexer_compressor_gate"),
                    &[d, 2 * di],
                    w,
                    rand(inv(d), d),
                );
                push(
                    b("indexer_compressor_ape"),
                    &[2 * di, 4],
                    w,
                    rand(0.5, 2 * di),
                );
                push(b("indexer_compressor_norm"), &[di], f32v, one);
            }
        }
        push(b("ffn_gate_inp"), &[d, ne], f32v, o.router_fill(i));
        if i < x.hash_layers {
            push(
                b("ffn_gate_tid2eid"),
                &[k, nv],
                Want::Keep(GgmlType::I32),
                Fill::ExpertIds { n: s.n_expert },
            );
        } else {
            push(
                format!("blk.{i}.exp_probs_b.bias"),
                &[ne],
                f32v,
                rand(0.01, ne),
            );
        }
        push(b("ffn_norm"), &[d], f32v, one);
        push(b("ffn_gate_exps"), &[d, ff, ne], w, rand(inv(d), d));
        push(
            b("ffn_down_exps"),
            &[ff, d, ne],
            w,
            writes(inv(ff), Half::Token),
        );
        push(b("ffn_up_exps"), &[d, ff, ne], w, rand(inv(d), d));
        push(b("ffn_gate_shexp"), &[d, fs], w, rand(inv(d), d));
        push(
            b("ffn_down_shexp"),
            &[fs, d],
            w,
            writes(inv(fs), Half::Token),
        );
        push(b("ffn_up_shexp"), &[d, fs], w, rand(inv(d), d));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::super::tests::options;
    use super::super::{generate, GenArch, Preset, TypeScheme};
    use super::*;
    use crate::gguf::GgufFile;

    /// Options of a deepseek4 file of `preset` (its generic shape) in `types`.
    fn ds4(preset: Preset, types: TypeScheme) -> GenOptions {
        let mut o = options(preset, types);
        o.shape = preset.shape_for(GenArch::Deepseek4).unwrap();
        o
    }

    /// (name, dims, type) of every planned tensor, in order.
    fn planned(o: &GenOptions) -> Vec<(String, Vec<u64>, GgmlType)> {
        o.validate().unwrap();
        o.plan(&mut Vec::new())
            .unwrap()
            .into_iter()
            .map(|p| (p.spec.name, p.spec.dims, p.spec.ty))
            .collect()
    }

    /// tiny's tensors are llama.cpp's (`load_arch_tensors`), in its order and with its shapes
    /// (E 256, H 4 × d 64, q_r 128, G 2 × R_o 32, indexer 2 × 128, 16 experts of 256, top-4,
    /// ratios 0 4 128 4, one hash layer, the test vocabulary's 300 tokens).
    #[test]
    fn tiny_plans_llama_cpp_s_tensors_in_its_order() {
        let plan = planned(&ds4(Preset::Tiny, TypeScheme::pure(GgmlType::F32)));
        let layer = |i: u32| -> Vec<(String, Vec<u64>)> {
            plan.iter()
                .filter(|(n, _, _)| n.starts_with(&format!("blk.{i}.")))
                .map(|(n, d, _)| {
                    (
                        n.trim_start_matches(&format!("blk.{i}.")).to_string(),
                        d.clone(),
                    )
                })
                .collect()
        };
        let want = |rows: &[(&str, &[u64])]| -> Vec<(String, Vec<u64>)> {
            rows.iter()
                .map(|(n, d)| (n.to_string(), d.to_vec()))
                .collect()
        };
        let head: &[(&str, &[u64])] = &[
            ("attn_norm.weight", &[256]),
            ("attn_sinks.weight", &[4]),
            ("attn_q_a.weight", &[256, 128]),
            ("attn_q_a_norm.weight", &[128]),
            ("attn_q_b.weight", &[128, 256]),
            ("attn_kv.weight", &[256, 64]),
            ("attn_kv_a_norm.weight", &[64]),
            ("attn_output_a.weight", &[128, 64]),
            ("attn_output_b.weight", &[64, 256]),
            ("hc_attn_fn.weight", &[1024, 24]),
            ("hc_attn_base.weight", &[24]),
            ("hc_attn_scale.weight", &[3]),
            ("hc_ffn_fn.weight", &[1024, 24]),
            ("hc_ffn_base.weight", &[24]),
            ("hc_ffn_scale.weight", &[3]),
        ];
        let ffn = |routing: (&'static str, &'static [u64])| -> Vec<(&'static str, &'static [u64])> {
            vec![
                ("ffn_gate_inp.weight", &[256, 16]),
                routing,
                ("ffn_norm.weight", &[256]),
                ("ffn_gate_exps.weight", &[256, 256, 16]),
                ("ffn_down_exps.weight", &[256, 256, 16]),
                ("ffn_up_exps.weight", &[256, 256, 16]),
                ("ffn_gate_shexp.weight", &[256, 256]),
                ("ffn_down_shexp.weight", &[256, 256]),
                ("ffn_up_shexp.weight", &[256, 256]),
            ]
        };
        let hash = ("ffn_gate_tid2eid.weight", &[4u64, 300] as &[u64]);
        let bias = ("exp_probs_b.bias", &[16u64] as &[u64]);
        let csa: &[(&str, &[u64])] = &[
            ("attn_compressor_kv.weight", &[256, 128]),
            ("attn_compressor_gate.weight", &[256, 128]),
            ("attn_compressor_ape.weight", &[128, 4]),
            ("attn_compressor_norm.weight", &[64]),
            ("indexer.proj.weight", &[256, 8]),
            ("indexer.attn_q_b.weight", &[128, 1024]),
            ("indexer_compressor_kv.weight", &[256, 256]),
            ("indexer_compressor_gate.weight", &[256, 256]),
            ("indexer_compressor_ape.weight", &[256, 4]),
            ("indexer_compressor_norm.weight", &[128]),
        ];
        let hca: &[(&str, &[u64])] = &[
            ("attn_compressor_kv.weight", &[256, 64]),
            ("attn_compressor_gate.weight", &[256, 64]),
            ("attn_compressor_ape.weight", &[64, 128]),
            ("attn_compressor_norm.weight", &[64]),
        ];
        let cat = |parts: &[&[(&str, &[u64])]]| want(&parts.concat());
        assert_eq!(layer(0), cat(&[head, &ffn(hash)]));
        assert_eq!(layer(1), cat(&[head, csa, &ffn(bias)]));
        assert_eq!(layer(2), cat(&[head, hca, &ffn(bias)]));
        assert_eq!(layer(3), layer(1).into_iter().collect::<Vec<_>>());
        let root: Vec<(String, Vec<u64>)> = plan
            .iter()
            .filter(|(n, _, _)| !n.starts_with("blk."))
            .map(|(n, d, _)| (n.clone(), d.clone()))
            .collect();
        assert_eq!(
            root,
            want(&[
                ("token_embd.weight", &[256, 300]),
                ("output_norm.weight", &[256]),
                ("output.weight", &[256, 300]),
                ("output_hc_fn.weight", &[1024, 4]),
                ("output_hc_base.weight", &[4]),
                ("output_hc_scale.weight", &[1]),
            ])
        );
        // The root first, then the layers in order.
        assert!(plan[..6].iter().all(|(n, _, _)| !n.starts_with("blk.")));
        let layers: Vec<u32> = plan[6..]
            .iter()
            .map(|(n, _, _)| n.split('.').nth(1).unwrap().parse().unwrap())
            .collect();
        assert!(layers.windows(2).all(|w| w[0] <= w[1]));
        // The hash table is I32 whatever the weights' type; the router and norms F32.
        let q = planned(&ds4(Preset::Tiny, TypeScheme::q4_k_m()));
        let ty = |n: &str| q.iter().find(|p| p.0 == n).unwrap().2;
        assert_eq!(ty("blk.0.ffn_gate_tid2eid.weight"), GgmlType::I32);
        assert_eq!(ty("blk.0.ffn_gate_inp.weight"), GgmlType::F32);
        assert_eq!(ty("blk.1.attn_compressor_norm.weight"), GgmlType::F32);
        assert_eq!(ty("blk.1.attn_sinks.weight"), GgmlType::F32);
    }

    /// The keys llama.cpp's loader requires, with tiny's values and tiny-odd's differences.
    #[test]
    fn keys_are_llama_cpp_s() {
        let o = ds4(Preset::Tiny, TypeScheme::q4_k_m());
        let meta = o.metadata().unwrap();
        let key = |k: &str| {
            meta.iter()
                .find(|(n, _)| n == &format!("deepseek4.{k}"))
                .map(|(_, v)| v.clone())
        };
        let u = |k: &str| key(k).and_then(|v| v.as_u64());
        let f = |k: &str| key(k).and_then(|v| v.as_f64());
        let arr = |k: &str| {
            key(k)
                .and_then(|v| v.as_array().map(|a| a.to_vec()))
                .unwrap_or_default()
        };
        assert_eq!(
            meta.iter()
                .find(|(n, _)| n == "general.architecture")
                .map(|x| &x.1),
            Some(&Value::String("deepseek4".into()))
        );
        for (k, v) in [
            ("embedding_length", 256),
            ("block_count", 4),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 1),
            ("attention.key_length", 64),
            ("attention.value_length", 64),
            ("rope.dimension_count", 16),
            ("attention.q_lora_rank", 128),
            ("attention.sliding_window", 16),
            ("expert_count", 16),
            ("expert_used_count", 4),
            ("expert_feed_forward_length", 256),
            ("expert_shared_count", 1),
            ("expert_gating_func", 4),
            ("attention.indexer.head_count", 8),
            ("attention.indexer.key_length", 128),
            ("attention.indexer.top_k", 4),
            ("attention.output_group_count", 2),
            ("attention.output_lora_rank", 32),
            ("hyper_connection.count", 4),
            ("hyper_connection.sinkhorn_iterations", 20),
            ("hash_layer_count", 1),
            ("rope.scaling.original_context_length", 1024),
        ] {
            assert_eq!(u(k), Some(v), "{k}");
        }
        for (k, v) in [
            ("rope.freq_base", 1e4),
            ("attention.compress_rope_freq_base", 1.6e5),
            ("expert_weights_scale", 1.5),
            ("rope.scaling.factor", 4.0),
            ("hyper_connection.epsilon", 1e-6),
        ] {
            let got = f(k).unwrap_or_else(|| panic!("{k}"));
            assert!((got - v).abs() <= 1e-6 * v, "{k}: {got}");
        }
        assert_eq!(key("expert_weights_norm"), Some(Value::Bool(true)));
        assert_eq!(key("rope.scaling.type"), Some(Value::String("yarn".into())));
        assert_eq!(
            key("attention.compress_ratios"),
            Some(Value::Array(
                ValueType::U32,
                [0, 4, 128, 4].map(Value::U32).to_vec()
            ))
        );
        assert_eq!(arr("swiglu_clamp_exp"), vec![Value::F32(1.0); 4]);
        assert_eq!(key("swiglu_clamp_shexp"), None);
        // tiny-odd: the shared expert's own limit, every layer compressed, two hash layers.
        let odd = ds4(Preset::TinyOdd, TypeScheme::q4_k_m());
        let meta = odd.metadata().unwrap();
        let key = |k: &str| {
            meta.iter()
                .find(|(n, _)| n == &format!("deepseek4.{k}"))
                .map(|(_, v)| v.clone())
        };
        assert_eq!(
            key("swiglu_clamp_shexp"),
            Some(Value::Array(ValueType::F32, vec![Value::F32(0.8); 4]))
        );
        assert_eq!(
            key("attention.compress_ratios"),
            Some(Value::Array(
                ValueType::U32,
                [4, 128, 4, 128].map(Value::U32).to_vec()
            ))
        );
        assert_eq!(key("hash_layer_count"), Some(Value::U32(2)));
        assert_eq!(key("embedding_length"), Some(Value::U32(288)));
    }

    /// tiny-odd has no row a multiple of 256, so every K-quant falls back to its 32-value
    /// stand-in, as llama-quantize's does.
    #[test]
    fn tiny_odd_rows_are_off_256() {
        let mut fallbacks = Vec::new();
        let o = ds4(Preset::TinyOdd, TypeScheme::q4_k_m());
        o.validate().unwrap();
        let plan = o.plan(&mut fallbacks).unwrap();
        for p in plan.iter().filter(|p| p.spec.dims.len() > 1) {
            assert_ne!(p.spec.dims[0] % 256, 0, "{}", p.spec.name);
            assert!(
                !matches!(p.spec.ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K),
                "{} is {}",
                p.spec.name,
                p.spec.ty
            );
        }
        assert!(!fallbacks.is_empty());
    }

    /// Every `--type` plans tensors the kernels take (the I32 hash table aside), on both
    /// tiny shapes.
    #[test]
    fn every_type_plans_loadable_tensors() {
        for preset in [Preset::Tiny, Preset::TinyOdd] {
            for name in [
                "f32",
                "f16",
                "bf16",
                "q8_0",
                "q4_0",
                "q4_1",
                "q5_0",
                "q5_1",
                "q2_k",
                "q3_k_s",
                "q3_k_m",
                "q3_k_l",
                "q4_k_s",
                "q4_k_m",
                "q5_k_s",
                "q5_k_m",
                "q6_k",
                "iq4_nl",
                "iq4_xs",
                "mxfp4_moe",
                "q4_k",
                "q5_k",
                "q3_k",
                "mxfp4",
            ] {
                let o = ds4(preset, TypeScheme::from_name(name).unwrap());
                for (n, dims, ty) in planned(&o) {
                    if n.ends_with("ffn_gate_tid2eid.weight") {
                        assert_eq!(ty, GgmlType::I32);
                        continue;
                    }
                    assert!(
                        crate::kernels::supports_dot(ty),
                        "{preset:?} {name}: {n} is {ty}"
                    );
                    assert!(ty.row_bytes(dims[0]).is_some(), "{n}");
                }
            }
        }
    }

    /// The written file holds what was planned: every F32 finite, and each hash-table row K
    /// distinct experts.
    #[test]
    fn the_file_is_written_and_sound() {
        let dir = crate::testdata::scratch_dir("gen-deepseek4");
        for preset in [Preset::Tiny, Preset::TinyOdd] {
            let o = ds4(preset, TypeScheme::pure(GgmlType::F32));
            let path = dir.join(format!("{}.gguf", preset.name()));
            let rep = generate(&o, &path, |_, _| {}).unwrap();
            let f = GgufFile::open(&path).unwrap();
            assert_eq!(f.architecture(), Some("deepseek4"));
            assert_eq!(f.tensors().len(), rep.n_tensors);
            let plan = planned(&o);
            for (t, (n, dims, ty)) in f.tensors().iter().zip(&plan) {
                assert_eq!((&t.name, &t.dims, t.ty), (n, dims, *ty));
                let data = f.tensor_data(t);
                if t.ty == GgmlType::F32 {
                    assert!(
                        data.chunks_exact(4)
                            .all(|b| f32::from_le_bytes(b.try_into().unwrap()).is_finite()),
                        "{n}"
                    );
                }
            }
            let k = o.shape.n_expert_used as usize;
            for i in 0..o.shape.deepseek4.as_ref().unwrap().hash_layers {
                let t = f
                    .tensor(&format!("blk.{i}.ffn_gate_tid2eid.weight"))
                    .unwrap();
                let ids: Vec<i32> = f
                    .tensor_data(t)
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                assert_eq!(ids.len(), k * 300);
                let mut used = vec![0u32; o.shape.n_expert as usize];
                for row in ids.chunks(k) {
                    let mut r = row.to_vec();
                    r.sort_unstable();
                    r.dedup();
                    assert_eq!(r.len(), k, "{row:?}");
                    for &e in row {
                        used[usize::try_from(e).unwrap()] += 1;
                    }
                }
                assert!(used.iter().all(|&n| n > 0), "{used:?}");
            }
            // The hyper-connection scales are near 1, the base and sinks not all alike.
            let floats = |n: &str| -> Vec<f32> {
                f.tensor_data(f.tensor(n).unwrap())
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect()
            };
            assert!(floats("blk.0.hc_attn_scale.weight")
                .iter()
                .all(|v| (0.5..1.5).contains(v)));
            let sinks = floats("blk.0.attn_sinks.weight");
            assert!(sinks.iter().any(|&v| v != sinks[0]));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Shapes llama.cpp would refuse or assert on are refused, naming what is wrong.
    #[test]
    fn shapes_llama_cpp_cannot_load_are_refused() {
        let base = Preset::Tiny.shape_for(GenArch::Deepseek4).unwrap();
        Deepseek4.validate(&base).unwrap();
        let bad = |f: &dyn Fn(&mut ModelShape, &mut Deepseek4Shape)| {
            let mut s = base.clone();
            let mut x = s.deepseek4.take().unwrap();
            f(&mut s, &mut x);
            s.deepseek4 = Some(x);
            Deepseek4.validate(&s).unwrap_err()
        };
        assert!(bad(&|s, _| s.n_head = 3).contains("H % G"));
        assert!(bad(&|_, x| x.o_groups = 0).contains("output groups"));
        assert!(bad(&|_, x| x.hc = 2).contains("asserts 4"));
        assert!(bad(&|_, x| x.indexer_dim = 32).contains("Hadamard"));
        assert!(bad(&|_, x| x.indexer_dim = 96).contains("Hadamard"));
        assert!(bad(&|_, x| x.indexer_top_k = 0).contains("indexer"));
        assert!(bad(&|s, _| s.n_head_kv = 2).contains("one key-and-value head"));
        assert!(bad(&|_, x| x.rope = 15).contains("rotated"));
        assert!(bad(&|_, x| x.rope = 96).contains("rotated"));
        assert!(bad(&|s, _| s.head_dim = 80).contains("--head-dim"));
        assert!(bad(&|_, x| x.q_lora_rank = 100).contains("query LoRA"));
        assert!(bad(&|_, x| x.o_lora_rank = 20).contains("output LoRA"));
        assert!(bad(&|_, x| x.hash_layers = 5).contains("hash layers"));
        assert!(bad(&|_, x| x.sinkhorn_iters = 0).contains("Sinkhorn"));
        assert!(bad(&|_, x| x.n_shared = 0).contains("shared expert"));
        assert!(bad(&|s, _| s.n_ff_shexp = 256).contains("--shared-ffn"));
        assert!(bad(&|s, _| s.tie_output = true).contains("--tie-output"));
        assert!(bad(&|s, _| s.n_swa = 0).contains("window"));
        assert!(bad(&|s, _| s.n_layer = 600).contains("512"));
        assert!(bad(&|s, x| {
            s.n_layer = 1;
            x.hash_layers = 0;
        })
        .contains("compressed by 4"));
        assert!(bad(&|_, x| x.swiglu_exp = f32::NAN).contains("finite"));
        assert!(bad(&|s, _| s.yarn_orig_ctx = 0).contains("original context"));
        let mut none = base.clone();
        none.deepseek4 = None;
        assert!(Deepseek4.validate(&none).is_err());
        // Through the options: a generic override that breaks the grouping is refused there.
        let mut o = ds4(Preset::Tiny, TypeScheme::q4_k_m());
        o.shape.n_head = 6;
        o.validate().unwrap();
        o.shape.n_head = 5;
        assert!(o.validate().is_err());
        // Layer overrides keep the pattern: 0, then 4 and 128 by turns.
        let x = base.deepseek4.as_ref().unwrap();
        assert_eq!(
            (0..8).map(|i| x.ratio(i)).collect::<Vec<_>>(),
            [0, 4, 128, 4, 128, 4, 128, 4]
        );
    }

    /// The DeepSeek-V4-Flash shape plans its real tensors (43 layers, the last ratio 4) with
    /// MXFP4 experts, and is deepseek4's alone.
    #[test]
    fn the_flash_shape_plans_the_real_tensors() {
        let p = Preset::DeepseekV4FlashShape;
        let o = GenOptions {
            shape: p.shape(),
            ..options(p, p.default_types())
        };
        let plan = planned(&o);
        let get = |n: &str| plan.iter().find(|t| t.0 == n).map(|t| (t.1.clone(), t.2));
        let d = |n: &str| get(n).map(|t| t.0);
        assert_eq!(d("blk.0.attn_q_b.weight"), Some(vec![1024, 32768]));
        assert_eq!(d("blk.0.attn_output_a.weight"), Some(vec![4096, 8192]));
        assert_eq!(d("blk.0.attn_output_b.weight"), Some(vec![8192, 4096]));
        assert_eq!(d("blk.0.hc_attn_fn.weight"), Some(vec![16384, 24]));
        assert_eq!(d("blk.2.ffn_gate_tid2eid.weight"), Some(vec![6, 300]));
        assert_eq!(d("blk.3.ffn_gate_tid2eid.weight"), None);
        assert_eq!(d("blk.1.attn_compressor_kv.weight"), None);
        assert_eq!(d("blk.2.attn_compressor_kv.weight"), Some(vec![4096, 1024]));
        assert_eq!(d("blk.2.indexer.attn_q_b.weight"), Some(vec![1024, 8192]));
        assert_eq!(d("blk.3.attn_compressor_ape.weight"), Some(vec![512, 128]));
        assert_eq!(d("blk.3.indexer.proj.weight"), None);
        assert_eq!(d("blk.42.indexer.proj.weight"), Some(vec![4096, 64]));
        assert_eq!(
            d("blk.42.ffn_down_exps.weight"),
            Some(vec![2048, 4096, 256])
        );
        assert_eq!(d("blk.43.attn_norm.weight"), None);
        assert_eq!(
            get("blk.5.ffn_up_exps.weight").map(|t| t.1),
            Some(GgmlType::MXFP4)
        );
        assert_eq!(
            get("blk.5.attn_kv.weight").map(|t| t.1),
            Some(GgmlType::Q8_0)
        );
        let x = o.shape.deepseek4.as_ref().unwrap();
        let ratios: Vec<u32> = (0..43).map(|i| x.ratio(i)).collect();
        assert_eq!(ratios[..4], [0, 0, 4, 128]);
        assert_eq!(ratios[42], 4);
        assert_eq!(ratios.iter().filter(|&&r| r == 4).count(), 21);
        assert_eq!(Preset::from_name("deepseek-v4-flash-shape"), Some(p));
        assert_eq!(p.default_types().label(), "MXFP4_MOE");
        assert!(p.shape_for(GenArch::Deepseek2).is_err());
        assert!(Preset::DeepseekV2LiteShape
            .shape_for(GenArch::Deepseek4)
            .is_err());
        assert_eq!(
            GenArch::Deepseek4.presets(),
            ["tiny", "tiny-odd", "small", "deepseek-v4-flash-shape"]
        );
    }
}
