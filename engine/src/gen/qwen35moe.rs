//! `gen --arch qwen35moe` (llama.cpp's `src/models/qwen35moe.cpp`, `load_arch_hparams` /
//! `load_arch_tensors`): Gated DeltaNet layers (`attn_qkv`, `attn_gate`, `ssm_*`) with gated
//! full attention every `full_attention_interval`-th layer (`attn_q` twice as wide: each
//! head's query and its output gate), `post_attention_norm` before the router, the routed
//! experts (a fused `ffn_gate_up_exps`, or split) beside a sigmoid-gated shared expert, and an
//! MTP block at layer index `n_layer` (`nextn_predict_layers` = 1; `block_count` counts it).
//!
//! Weights follow the generator's two halves: the mixers (DeltaNet's `ssm_out`, attention's
//! `attn_output`) write the context half, the experts and the shared expert the token half.

use super::{
    Fallbacks, Family, Fill, GenError, GenOptions, Half, ModelShape, Planned, Preset, Want,
};
use crate::gguf::{GgmlType, Value, ValueType};

pub(super) struct Qwen35Moe;

/// What qwen35moe adds to a [`ModelShape`].
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen35Shape {
    /// Every `full_attention_interval`-th layer attends; the others are Gated DeltaNet.
    pub full_attention_interval: u32,
    /// Rotated dimensions of a head (`rope.dimension_count`) and the multi-section rope's
    /// sections (t, h, w, e pairs).
    pub n_rot: u32,
    pub rope_sections: [u32; 4],
    /// `ssm.conv_kernel`, `ssm.state_size` (a DeltaNet head's width), `ssm.group_count` (key
    /// heads), `ssm.time_step_rank` (value heads).
    pub d_conv: u32,
    pub d_state: u32,
    pub n_k_heads: u32,
    pub n_v_heads: u32,
    /// MTP blocks after the trunk (`nextn_predict_layers`).
    pub n_nextn: u32,
    /// Experts' gate and up in one `ffn_gate_up_exps` (else split `ffn_{gate,up}_exps`).
    pub fused_gate_up: bool,
}

impl Qwen35Shape {
    /// For a generic size: attention every other layer (so a 4-layer file has two of each),
    /// a quarter of each head rotated in three sections, two key heads read by four value
    /// heads (each key head by two: the tiling matters), heads of half the attention's width,
    /// an MTP block. tiny-odd splits its experts' gate and up, the others fuse them.
    pub fn generic(preset: Preset, s: &ModelShape) -> Qwen35Shape {
        let n_rot = (s.head_dim / 4).max(2) & !1;
        let pairs = n_rot / 2;
        let third = pairs.div_ceil(3);
        Qwen35Shape {
            full_attention_interval: if preset == Preset::Small { 4 } else { 2 },
            n_rot,
            rope_sections: [third, third, pairs - 2 * third, 0],
            d_conv: 4,
            d_state: s.head_dim / 2,
            n_k_heads: 2,
            n_v_heads: 4,
            n_nextn: 1,
            fused_gate_up: preset != Preset::TinyOdd,
        }
    }

    /// Qwen3.5/3.6-35B-A3B's text model: 40 layers in ten groups of three Gated DeltaNet and
    /// one gated attention, 32 value and 16 key heads of 128 for DeltaNet, a convolution of 4,
    /// a quarter of the 256-wide attention heads rotated in sections 11/11/10 (the
    /// `text_config` of `Qwen/Qwen3.6-35B-A3B`'s config.json: `linear_num_value_heads`,
    /// `linear_num_key_heads`, `linear_key_head_dim`, `linear_conv_kernel_dim`,
    /// `partial_rotary_factor` 0.25, `mrope_section`, `mtp_num_hidden_layers` 1), and the
    /// experts fused as llama.cpp's converter writes them.
    pub fn qwen36_35b_a3b() -> Qwen35Shape {
        Qwen35Shape {
            full_attention_interval: 4,
            n_rot: 64,
            rope_sections: [11, 11, 10, 0],
            d_conv: 4,
            d_state: 128,
            n_k_heads: 16,
            n_v_heads: 32,
            n_nextn: 1,
            fused_gate_up: true,
        }
    }

    fn is_recurrent(&self, layer: u32) -> bool {
        !(layer + 1).is_multiple_of(self.full_attention_interval)
    }

    fn conv_channels(&self) -> u64 {
        (2 * self.n_k_heads * self.d_state + self.n_v_heads * self.d_state) as u64
    }

    fn value_dim(&self) -> u64 {
        (self.n_v_heads * self.d_state) as u64
    }
}

fn q35(s: &ModelShape) -> Result<&Qwen35Shape, String> {
    s.qwen35
        .as_ref()
        .ok_or_else(|| "qwen35moe needs its layer pattern (a qwen35moe preset)".to_string())
}

impl Family for Qwen35Moe {
    /// A generic size gains qwen35moe's parts (see [`Qwen35Shape::generic`]) and a shared
    /// expert as wide as llama.cpp's K-quants allow (256-multiples, except on tiny-odd).
    fn generic(&self, preset: Preset, s: &mut ModelShape) {
        s.qwen35 = Some(Qwen35Shape::generic(preset, s));
        s.n_ff_shexp = match preset {
            Preset::TinyOdd => 320,
            Preset::Small => 2048,
            _ => 512,
        };
    }

    fn validate(&self, s: &ModelShape) -> Result<(), String> {
        let q = q35(s)?;
        if s.n_ff_shexp == 0 || !s.n_ff_shexp.is_multiple_of(32) {
            return Err(format!(
                "--shared-ffn {} must be a positive multiple of 32 (qwen35moe's shared expert)",
                s.n_ff_shexp
            ));
        }
        if q.full_attention_interval == 0 {
            return Err("qwen35moe: full_attention_interval must be positive".into());
        }
        if q.n_rot == 0 || !q.n_rot.is_multiple_of(2) || q.n_rot > s.head_dim {
            return Err(format!(
                "qwen35moe: {} rotated dimensions must be even, positive and at most the head width {}",
                q.n_rot, s.head_dim
            ));
        }
        let pairs: u32 = q.rope_sections.iter().sum();
        if pairs == 0 || pairs > q.n_rot / 2 {
            return Err(format!(
                "qwen35moe: rope sections {:?} must add up to 1..={}",
                q.rope_sections,
                q.n_rot / 2
            ));
        }
        if q.d_conv == 0 || q.d_state == 0 || q.n_k_heads == 0 {
            return Err("qwen35moe: the DeltaNet dimensions must be positive".into());
        }
        if q.n_v_heads == 0 || !q.n_v_heads.is_multiple_of(q.n_k_heads) {
            return Err(format!(
                "qwen35moe: {} value heads must be a multiple of {} key heads",
                q.n_v_heads, q.n_k_heads
            ));
        }
        if !q.value_dim().is_multiple_of(32) {
            return Err("qwen35moe: value heads x state size must be a multiple of 32".into());
        }
        if q.n_nextn > 1 {
            return Err("qwen35moe: at most one MTP block".into());
        }
        Ok(())
    }

    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError> {
        let s = &o.shape;
        let q = q35(s).map_err(GenError::Invalid)?;
        let k = |n: &str| format!("qwen35moe.{n}");
        let u32s = |v: &[u32]| {
            Value::Array(
                ValueType::I32,
                v.iter().map(|&x| Value::I32(x as i32)).collect(),
            )
        };
        Ok(vec![
            (k("context_length"), Value::U32(s.n_ctx_train)),
            (k("embedding_length"), Value::U32(s.d_model)),
            (k("block_count"), Value::U32(s.n_layer + q.n_nextn)),
            (k("nextn_predict_layers"), Value::U32(q.n_nextn)),
            (k("feed_forward_length"), Value::U32(s.n_ff_shexp)),
            (k("attention.head_count"), Value::U32(s.n_head)),
            (k("attention.head_count_kv"), Value::U32(s.n_head_kv)),
            (k("attention.key_length"), Value::U32(s.head_dim)),
            (k("attention.value_length"), Value::U32(s.head_dim)),
            (k("rope.dimension_count"), Value::U32(q.n_rot)),
            (k("rope.dimension_sections"), u32s(&q.rope_sections)),
            (k("rope.freq_base"), Value::F32(s.rope_base)),
            (k("attention.layer_norm_rms_epsilon"), Value::F32(s.rms_eps)),
            (k("expert_count"), Value::U32(s.n_expert)),
            (k("expert_used_count"), Value::U32(s.n_expert_used)),
            (k("expert_feed_forward_length"), Value::U32(s.n_ff_exp)),
            (
                k("expert_shared_feed_forward_length"),
                Value::U32(s.n_ff_shexp),
            ),
            (k("ssm.conv_kernel"), Value::U32(q.d_conv)),
            (k("ssm.state_size"), Value::U32(q.d_state)),
            (k("ssm.group_count"), Value::U32(q.n_k_heads)),
            (k("ssm.time_step_rank"), Value::U32(q.n_v_heads)),
            (k("ssm.inner_size"), Value::U32(q.n_v_heads * q.d_state)),
            (
                k("full_attention_interval"),
                Value::U32(q.full_attention_interval),
            ),
        ])
    }

    fn plan(&self, o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
        plan(o, fallbacks)
    }
}

/// Every tensor of the file, in llama.cpp's order (the MTP block last).
fn plan(o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
    let s = &o.shape;
    let q = q35(s).map_err(GenError::Invalid)?;
    let d = s.d_model as u64;
    let nv = o.n_vocab()?;
    let split = s.d_model / 2;
    let ff = s.n_ff_exp as u64;
    let fs = s.n_ff_shexp as u64;
    let ne = s.n_expert as u64;
    let (qd, kvd) = (
        (s.n_head * s.head_dim) as u64,
        (s.n_head_kv * s.head_dim) as u64,
    );
    let (channels, vd, heads) = (q.conv_channels(), q.value_dim(), q.n_v_heads as u64);
    let inv = |n: u64| 1.0 / (n as f32).sqrt();
    // llama-quantize counts the MTP block among the layers (`block_count`).
    let mut model = o.mix_model();
    model.n_layer += q.n_nextn;
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
    for i in 0..s.n_layer + q.n_nextn {
        let b = |n: &str| format!("blk.{i}.{n}.weight");
        let w = Want::Weight(Some(i));
        let mtp = i >= s.n_layer;
        push(b("attn_norm"), &[d], f32v, one);
        if mtp || !q.is_recurrent(i) {
            push(b("attn_q"), &[d, 2 * qd], w, rand(inv(d)));
            push(b("attn_k"), &[d, kvd], w, rand(inv(d)));
            push(b("attn_v"), &[d, kvd], w, rand(inv(d)));
            push(
                b("attn_output"),
                &[qd, d],
                w,
                writes(inv(qd), Half::Context),
            );
            for n in ["attn_q_norm", "attn_k_norm"] {
                push(
                    b(n),
                    &[s.head_dim as u64],
                    f32v,
                    Fill::Const(o.attn_sharpness),
                );
            }
        } else {
            push(b("attn_qkv"), &[d, channels], w, rand(inv(d)));
            push(b("attn_gate"), &[d, vd], w, rand(inv(d)));
            push(
                b("ssm_conv1d"),
                &[q.d_conv as u64, channels],
                f32v,
                Fill::Rand {
                    std: 0.5,
                    lo: 0,
                    hi: q.d_conv,
                },
            );
            push(
                format!("blk.{i}.ssm_dt.bias"),
                &[heads],
                f32v,
                Fill::Rand {
                    std: 0.5,
                    lo: 0,
                    hi: q.n_v_heads,
                },
            );
            // −exp(A_log): negative, so every head's state decays.
            push(
                format!("blk.{i}.ssm_a"),
                &[heads],
                f32v,
                Fill::Ramp { lo: -1.0, hi: -0.1 },
            );
            push(b("ssm_beta"), &[d, heads], w, rand(inv(d)));
            push(b("ssm_alpha"), &[d, heads], w, rand(inv(d)));
            push(b("ssm_norm"), &[q.d_state as u64], f32v, one);
            push(b("ssm_out"), &[vd, d], w, writes(inv(vd), Half::Context));
        }
        push(b("post_attention_norm"), &[d], f32v, one);
        push(b("ffn_gate_inp"), &[d, ne], f32v, o.router_fill(i));
        if q.fused_gate_up {
            push(b("ffn_gate_up_exps"), &[d, 2 * ff, ne], w, rand(inv(d)));
        } else {
            push(b("ffn_gate_exps"), &[d, ff, ne], w, rand(inv(d)));
            push(b("ffn_up_exps"), &[d, ff, ne], w, rand(inv(d)));
        }
        push(
            b("ffn_down_exps"),
            &[ff, d, ne],
            w,
            writes(inv(ff), Half::Token),
        );
        push(b("ffn_gate_inp_shexp"), &[d], f32v, rand(inv(d)));
        push(b("ffn_gate_shexp"), &[d, fs], w, rand(inv(d)));
        push(b("ffn_up_shexp"), &[d, fs], w, rand(inv(d)));
        push(
            b("ffn_down_shexp"),
            &[fs, d],
            w,
            writes(inv(fs), Half::Token),
        );
        if mtp {
            // Both halves of the input (the token's embedding, then the trunk's hidden).
            let both = Fill::Rand {
                std: inv(2 * d),
                lo: 0,
                hi: 2 * s.d_model,
            };
            push(b("nextn.eh_proj"), &[2 * d, d], w, both);
            push(b("nextn.enorm"), &[d], f32v, one);
            push(b("nextn.hnorm"), &[d], f32v, one);
            push(b("nextn.shared_head_norm"), &[d], f32v, one);
        }
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

#[cfg(test)]
mod tests {
    use super::super::tests::options;
    use super::super::{generate, GenArch, Preset, TypeScheme};
    use super::*;
    use crate::arch::{load_model, qwen35moe::HParams};
    use crate::dense::DenseMode;
    use crate::gguf::GgufFile;
    use std::sync::Arc;

    /// The full shape plans Qwen3.6-35B-A3B's tensors: 30 DeltaNet and 10 attention layers,
    /// the MTP block as layer 40, DeltaNet's q/k/v of 16 + 16 key heads and 32 value heads of
    /// 128, attention's query and gate side by side.
    #[test]
    fn the_full_shape_plans_the_real_tensors() {
        let mut o = options(Preset::Qwen36_35bA3bShape, TypeScheme::q4_k_m());
        o.shape = Preset::Qwen36_35bA3bShape.shape();
        o.validate().unwrap();
        let mut fallbacks = Vec::new();
        let plan = o.plan(&mut fallbacks).unwrap();
        let dims = |n: &str| {
            plan.iter()
                .find(|p| p.spec.name == n)
                .map(|p| (p.spec.dims.clone(), p.spec.ty))
        };
        let d = |n: &str| dims(n).map(|x| x.0);
        assert_eq!(d("blk.0.attn_qkv.weight"), Some(vec![2048, 8192]));
        assert_eq!(d("blk.0.attn_gate.weight"), Some(vec![2048, 4096]));
        assert_eq!(d("blk.0.ssm_conv1d.weight"), Some(vec![4, 8192]));
        assert_eq!(d("blk.0.ssm_out.weight"), Some(vec![4096, 2048]));
        assert_eq!(d("blk.0.ssm_a"), Some(vec![32]));
        assert_eq!(d("blk.3.attn_q.weight"), Some(vec![2048, 8192]));
        assert_eq!(d("blk.3.attn_k.weight"), Some(vec![2048, 512]));
        assert_eq!(d("blk.3.attn_qkv.weight"), None);
        assert_eq!(d("blk.39.attn_q.weight"), Some(vec![2048, 8192]));
        assert_eq!(
            d("blk.39.ffn_gate_up_exps.weight"),
            Some(vec![2048, 1024, 256])
        );
        assert_eq!(d("blk.40.nextn.eh_proj.weight"), Some(vec![4096, 2048]));
        assert_eq!(d("blk.41.attn_norm.weight"), None);
        let recurrent = (0..40)
            .filter(|i| d(&format!("blk.{i}.attn_qkv.weight")).is_some())
            .count();
        assert_eq!(recurrent, 30);
        // llama-quantize's Q4_K_M: the conv taps stay F32, attention-v-like tensors (DeltaNet's
        // qkv counts as one) get Q6_K on the layers llama-quantize gives more bits (the first
        // and last eighth of 41, and every third between), Q4_K elsewhere.
        let ty = |n: &str| dims(n).map(|x| x.1);
        assert_eq!(ty("blk.0.ssm_conv1d.weight"), Some(GgmlType::F32));
        assert_eq!(ty("blk.0.attn_qkv.weight"), Some(GgmlType::Q6_K));
        assert_eq!(ty("blk.9.attn_qkv.weight"), Some(GgmlType::Q4_K));
        assert_eq!(ty("blk.10.attn_qkv.weight"), Some(GgmlType::Q6_K));
        assert_eq!(ty("blk.10.ssm_out.weight"), Some(GgmlType::Q4_K));
        let meta = o.metadata().unwrap();
        let key = |k: &str| meta.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(key("qwen35moe.block_count"), Some(Value::U32(41)));
        assert_eq!(key("qwen35moe.ssm.inner_size"), Some(Value::U32(4096)));
    }

    /// Every llama-quantize preset gen writes makes a qwen35moe file the engine loads and
    /// runs (a small shape, so the presets' fallbacks for 96-wide rows apply too).
    #[test]
    fn every_preset_makes_a_file_that_runs() {
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
        ] {
            let mut o = options(Preset::TinyOdd, TypeScheme::from_name(name).unwrap());
            o.shape = Preset::TinyOdd.shape_for(GenArch::Qwen35Moe).unwrap();
            o.shape.n_expert = 4;
            o.shape.n_expert_used = 2;
            o.shape.n_layer = 2;
            let path = std::env::temp_dir().join(format!(
                "bmoe-gen-qwen35moe-{}-{name}.gguf",
                std::process::id()
            ));
            generate(&o, &path, |_, _| {}).unwrap();
            let file = Arc::new(GgufFile::open(&path).unwrap());
            let hp = HParams::from_gguf(&file).unwrap();
            assert_eq!((hp.n_layer, hp.n_nextn, hp.d_state), (2, 1, 24), "{name}");
            let model = load_model(file, DenseMode::Mmap, 1).unwrap();
            let mut st = model.new_state(8);
            model.begin(&mut st, &[1, 2, 3], &[0, 1, 2], &[2]).unwrap();
            let mut ro = crate::arch::RouteOut::default();
            let w = model.arch.weights();
            for l in 0..2 {
                model
                    .dense(&mut st, l)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                model.route(&mut st, l, &mut ro).unwrap();
                for (i, &e) in ro.ids.iter().enumerate() {
                    let proj: Vec<&[u8]> = model
                        .experts(l)
                        .iter()
                        .map(|x| w.expert_bytes(x, e as usize))
                        .collect();
                    let row = (i / ro.k) as u32;
                    let rank = (i % ro.k) as u16;
                    let uses = [(row, rank, ro.weights[i])];
                    model.expert(&mut st, l, e as usize, &proj, &uses).unwrap();
                }
                model.finish_layer(&mut st, l).unwrap();
            }
            model.head(&mut st).unwrap();
            assert!(st.logits.iter().all(|v| v.is_finite()), "{name}");
            let _ = std::fs::remove_file(&path);
        }
    }

    /// A file whose qwen35moe keys this build does not run is refused with the key named,
    /// never a panic.
    #[test]
    fn bad_keys_are_refused_by_name() {
        let mut o = options(Preset::Tiny, TypeScheme::q4_k_m());
        o.shape = Preset::Tiny.shape_for(GenArch::Qwen35Moe).unwrap();
        let meta = o.metadata().unwrap();
        let dir = crate::testdata::scratch_dir("qwen35moe-keys");
        let k = |n: &str| format!("qwen35moe.{n}");
        let cases: Vec<(String, Option<Value>)> = vec![
            (k("ssm.time_step_rank"), Some(Value::U32(3))),
            (k("ssm.inner_size"), Some(Value::U32(100))),
            (k("ssm.conv_kernel"), None),
            (k("ssm.group_count"), Some(Value::U32(0))),
            (k("nextn_predict_layers"), Some(Value::U32(2))),
            (k("block_count"), Some(Value::U32(1))),
            (k("rope.dimension_sections"), None),
            (
                k("rope.dimension_sections"),
                Some(Value::Array(ValueType::I32, vec![Value::I32(9); 3])),
            ),
            (k("rope.dimension_count"), Some(Value::U32(15))),
            (k("rope.scaling.type"), Some(Value::String("yarn".into()))),
            (k("expert_weights_scale"), Some(Value::F32(2.5))),
            (k("full_attention_interval"), Some(Value::U32(0))),
        ];
        for (key, value) in cases {
            let mut m: Vec<(String, Value)> =
                meta.iter().filter(|(n, _)| *n != key).cloned().collect();
            if let Some(v) = value.clone() {
                m.push((key.clone(), v));
            }
            let path = dir.join("meta.gguf");
            crate::gguf::GgufWriter::write_file(&path, &m, &[]).expect("write");
            let f = GgufFile::open(&path).expect("open");
            let err = HParams::from_gguf(&f).unwrap_err().to_string();
            assert!(err.contains(&key), "{key} = {value:?}: {err}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn shapes_it_cannot_make_are_refused() {
        let base = Preset::Tiny.shape_for(GenArch::Qwen35Moe).unwrap();
        let bad = |f: &dyn Fn(&mut Qwen35Shape)| {
            let mut s = base.clone();
            f(s.qwen35.as_mut().unwrap());
            Qwen35Moe.validate(&s).unwrap_err()
        };
        assert!(bad(&|q| q.n_v_heads = 3).contains("multiple"));
        assert!(bad(&|q| q.n_rot = 66).contains("rotated"));
        assert!(bad(&|q| q.rope_sections = [9, 0, 0, 0]).contains("sections"));
        assert!(bad(&|q| q.full_attention_interval = 0).contains("interval"));
        assert!(bad(&|q| q.n_nextn = 2).contains("MTP"));
        let mut none = base.clone();
        none.qwen35 = None;
        assert!(Qwen35Moe.validate(&none).is_err());
    }
}
