//! `gen --arch qwen2moe` (llama.cpp's `src/models/qwen2moe.cpp`): the llama-style file with
//! q/k/v biases instead of q/k norms, and per layer a shared expert beside the routed ones
//! (`ffn_{gate,up,down}_shexp`) with its sigmoid gate (`ffn_gate_inp_shexp`); like the
//! experts, it writes the token half of the residual stream.

use super::llama::{self, Extra, Style};
use super::{
    Fallbacks, Family, Fill, GenError, GenOptions, Half, ModelShape, Planned, Preset, Want,
};
use crate::gguf::{GgmlType, Value};

pub(super) struct Qwen2Moe;

impl Family for Qwen2Moe {
    /// A generic size gains a shared expert as wide as llama.cpp's K-quants allow
    /// (256-multiples, except on tiny-odd).
    fn generic(&self, preset: Preset, s: &mut ModelShape) {
        s.n_ff_shexp = match preset {
            Preset::TinyOdd => 320,
            Preset::Small => 2048,
            _ => 512,
        };
    }

    fn validate(&self, s: &ModelShape) -> Result<(), String> {
        if s.n_ff_shexp == 0 || !s.n_ff_shexp.is_multiple_of(32) {
            return Err(format!(
                "--shared-ffn {} must be a positive multiple of 32 (qwen2moe's shared expert)",
                s.n_ff_shexp
            ));
        }
        if s.tie_output {
            return Err("--tie-output: llama.cpp requires qwen2moe's output.weight".into());
        }
        Ok(())
    }

    /// `feed_forward_length` states the shared expert's width (llama.cpp's fallback for it).
    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError> {
        let s = &o.shape;
        let mut m = llama::metadata(o, s.n_ff_shexp);
        m.push((
            format!("{}.expert_shared_feed_forward_length", s.arch.name()),
            Value::U32(s.n_ff_shexp),
        ));
        Ok(m)
    }

    fn plan(&self, o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
        let s = &o.shape;
        let (d, fs, split) = (s.d_model as u64, s.n_ff_shexp as u64, s.d_model / 2);
        let inv = |n: u64| 1.0 / (n as f32).sqrt();
        let rand = |std: f32| Fill::Rand {
            std,
            lo: 0,
            hi: s.d_model,
        };
        let shared = |i: u32| -> Vec<Extra> {
            let b = |n: &str| format!("blk.{i}.{n}.weight");
            let weight = Want::Weight(Some(i));
            vec![
                (
                    b("ffn_gate_inp_shexp"),
                    vec![d],
                    Want::Keep(GgmlType::F32),
                    rand(inv(d)),
                ),
                (b("ffn_gate_shexp"), vec![d, fs], weight, rand(inv(d))),
                (b("ffn_up_shexp"), vec![d, fs], weight, rand(inv(d))),
                (
                    b("ffn_down_shexp"),
                    vec![fs, d],
                    weight,
                    Fill::RandRows {
                        std: inv(fs),
                        half: Half::Token,
                        split,
                    },
                ),
            ]
        };
        let style = Style {
            qk_norms: false,
            qkv_biases: true,
            ffn_norm: "ffn_norm",
        };
        llama::plan(o, fallbacks, &style, &shared)
    }
}
