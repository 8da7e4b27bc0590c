//! `gen --arch gpt-oss` (llama.cpp's `src/models/openai-moe.cpp` names and keys): the
//! llama-style file with q/k/v biases, the FFN norm named `post_attention_norm`, the sliding
//! window and YaRN keys, and per layer the attention output bias, the sinks, the router bias
//! and the experts' biases.

use super::llama::{self, Style};
use super::{Fallbacks, Family, Fill, GenError, GenOptions, ModelShape, Planned, Preset, Want};
use crate::gguf::{GgmlType, Value};

pub(super) struct GptOss;

impl Family for GptOss {
    fn generic(&self, _preset: Preset, s: &mut ModelShape) {
        tiny_extras(s);
    }

    fn validate(&self, s: &ModelShape) -> Result<(), String> {
        if s.n_ff_shexp != 0 {
            return Err("--shared-ffn: gpt-oss has no shared expert".into());
        }
        if s.tie_output {
            return Err("--tie-output: llama.cpp requires gpt-oss's output.weight".into());
        }
        Ok(())
    }

    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError> {
        let mut m = llama::metadata(o, o.shape.n_ff_exp);
        m.extend(metadata(&o.shape));
        Ok(m)
    }

    fn plan(&self, o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
        let style = Style {
            qk_norms: false,
            qkv_biases: true,
            ffn_norm: "post_attention_norm",
        };
        let extras = |i: u32| {
            layer_extras(&o.shape, i)
                .into_iter()
                .map(|(name, dims, fill)| (name, dims, Want::Keep(GgmlType::F32), fill))
                .collect()
        };
        llama::plan(o, fallbacks, &style, &extras)
    }
}

/// gpt-oss's own on a generic size (tiny, tiny-odd, small): a window that prompts of the
/// gates outgrow (so the ring is exercised), the real rotary base, and YaRN ×32 over an
/// original context the gates' positions pass.
fn tiny_extras(s: &mut ModelShape) {
    s.n_swa = 32;
    s.rope_base = 150_000.0;
    s.rms_eps = 1e-5;
    s.n_ctx_train = 8192;
    s.yarn_factor = 32.0;
    s.yarn_orig_ctx = 256;
}

/// The published gpt-oss shape with `n_layer` layers and `n_expert` experts (20b: 24 / 32;
/// 120b: 36 / 128); everything else they share.
pub(super) fn full_shape(n_layer: u32, n_expert: u32) -> ModelShape {
    ModelShape {
        arch: super::GenArch::GptOss,
        n_layer,
        n_expert,
        n_expert_used: 4,
        d_model: 2880,
        n_ff_exp: 2880,
        n_ff_shexp: 0,
        n_head: 64,
        n_head_kv: 8,
        head_dim: 64,
        n_ctx_train: 131_072,
        rope_base: 150_000.0,
        rms_eps: 1e-5,
        tie_output: false,
        n_swa: 128,
        yarn_factor: 32.0,
        yarn_orig_ctx: 4096,
        gemma: None,
        lfm2: None,
        qwen35: None,
        deepseek2: None,
        bailing: None,
        deepseek4: None,
    }
}

/// The keys gpt-oss states besides the generic ones.
fn metadata(s: &ModelShape) -> Vec<(String, Value)> {
    let k = |n: &str| format!("gpt-oss.{n}");
    let mut m = vec![(k("attention.sliding_window"), Value::U32(s.n_swa))];
    if s.yarn_factor > 0.0 {
        m.extend([
            (k("rope.scaling.type"), Value::String("yarn".into())),
            (k("rope.scaling.factor"), Value::F32(s.yarn_factor)),
            (
                k("rope.scaling.original_context_length"),
                Value::U32(s.yarn_orig_ctx),
            ),
        ]);
    }
    m
}

/// Layer `i`'s F32 extras: name, dims (GGUF order), fill. Biases are small, as trained ones
/// are; the attention output bias writes only the context half of the residual stream and
/// the experts' down bias only the token half (the generator's two halves, see `gen`).
fn layer_extras(s: &ModelShape, i: u32) -> Vec<(String, Vec<u64>, Fill)> {
    let (d, ff, ne) = (s.d_model as u64, s.n_ff_exp as u64, s.n_expert as u64);
    let split = s.d_model / 2;
    let bias = |lo: u32, hi: u32| Fill::Rand { std: 0.02, lo, hi };
    vec![
        (
            format!("blk.{i}.attn_output.bias"),
            vec![d],
            bias(split, s.d_model),
        ),
        // Sinks of the order of the attention scores, so they take a share of each softmax.
        (
            format!("blk.{i}.attn_sinks.weight"),
            vec![s.n_head as u64],
            Fill::Rand {
                std: 1.0,
                lo: 0,
                hi: s.n_head,
            },
        ),
        (
            format!("blk.{i}.ffn_gate_inp.bias"),
            vec![ne],
            Fill::Rand {
                std: 0.5,
                lo: 0,
                hi: s.n_expert,
            },
        ),
        (
            format!("blk.{i}.ffn_gate_exps.bias"),
            vec![ff, ne],
            bias(0, s.n_ff_exp),
        ),
        (
            format!("blk.{i}.ffn_up_exps.bias"),
            vec![ff, ne],
            bias(0, s.n_ff_exp),
        ),
        (
            format!("blk.{i}.ffn_down_exps.bias"),
            vec![d, ne],
            bias(0, split),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::{GenArch, GenOptions, Preset, TypeScheme};
    use crate::gguf::{GgmlType, Value};

    fn options(preset: Preset, types: TypeScheme) -> GenOptions {
        GenOptions {
            preset,
            shape: preset.shape_for(GenArch::GptOss).unwrap(),
            types,
            seed: 1,
            routing_context: 0.5,
            router_gain: 6.0,
            routing_depth: 0.75,
            attn_sharpness: 0.5,
            vocab: crate::vocab::builtin_vocab().unwrap(),
            threads: 1,
        }
    }

    #[test]
    fn gpt_oss_plans_sinks_biases_and_its_norm_names() {
        let opts = options(Preset::Tiny, TypeScheme::pure(GgmlType::F32));
        opts.validate().unwrap();
        let plan = opts.plan(&mut Vec::new()).unwrap();
        let dims = |n: &str| {
            plan.iter()
                .find(|p| p.spec.name == n)
                .map(|p| p.spec.dims.clone())
        };
        assert_eq!(dims("blk.0.attn_sinks.weight"), Some(vec![4]));
        assert_eq!(dims("blk.1.attn_output.bias"), Some(vec![256]));
        assert_eq!(dims("blk.2.ffn_gate_inp.bias"), Some(vec![16]));
        assert_eq!(dims("blk.3.ffn_gate_exps.bias"), Some(vec![384, 16]));
        assert_eq!(dims("blk.3.ffn_down_exps.bias"), Some(vec![256, 16]));
        assert_eq!(dims("blk.0.attn_q.bias"), Some(vec![256]));
        assert_eq!(dims("blk.0.post_attention_norm.weight"), Some(vec![256]));
        assert_eq!(dims("blk.0.ffn_norm.weight"), None);
        assert_eq!(dims("blk.0.attn_q_norm.weight"), None);
        let meta = opts.metadata().unwrap();
        let key = |k: &str| meta.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(
            key("general.architecture"),
            Some(Value::String("gpt-oss".into()))
        );
        assert_eq!(
            key("gpt-oss.attention.sliding_window"),
            Some(Value::U32(32))
        );
        assert_eq!(
            key("gpt-oss.rope.scaling.type"),
            Some(Value::String("yarn".into()))
        );
        // The full shapes are gpt-oss's own, with MXFP4 experts; no tied head, no shared
        // expert, and not another family's full shape.
        let s = Preset::GptOss20bShape.shape();
        assert_eq!(
            (s.n_layer, s.n_expert, s.d_model, s.n_swa),
            (24, 32, 2880, 128)
        );
        assert_eq!(Preset::GptOss120bShape.shape().n_expert, 128);
        assert_eq!(Preset::GptOss20bShape.default_types().label(), "MXFP4_MOE");
        assert!(Preset::Qwen3_30bA3bShape
            .shape_for(GenArch::GptOss)
            .is_err());
        assert!(Preset::GptOss20bShape.shape_for(GenArch::Qwen3Moe).is_err());
        let mut bad = options(Preset::Tiny, TypeScheme::pure(GgmlType::F32));
        bad.shape.tie_output = true;
        assert!(bad.validate().is_err());
        bad.shape.tie_output = false;
        bad.shape.n_ff_shexp = 64;
        assert!(bad.validate().is_err());
        assert_eq!(
            GenArch::GptOss.presets(),
            [
                "tiny",
                "tiny-odd",
                "small",
                "gpt-oss-20b-shape",
                "gpt-oss-120b-shape"
            ]
        );
    }
}
