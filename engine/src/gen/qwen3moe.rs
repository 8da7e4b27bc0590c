//! `gen --arch qwen3moe` (llama.cpp's `src/models/qwen3moe.cpp`): the llama-style file with
//! per-head q/k norms and routed experts only; `feed_forward_length` states
//! `expert_feed_forward_length × expert_used_count`, as older files do.

use super::llama::{self, Style};
use super::{Fallbacks, Family, GenError, GenOptions, ModelShape, Planned};
use crate::gguf::Value;

pub(super) struct Qwen3Moe;

impl Family for Qwen3Moe {
    fn validate(&self, s: &ModelShape) -> Result<(), String> {
        if s.n_ff_shexp != 0 {
            return Err("--shared-ffn: qwen3moe has no shared expert".into());
        }
        Ok(())
    }

    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError> {
        let s = &o.shape;
        Ok(llama::metadata(o, s.n_ff_exp * s.n_expert_used))
    }

    fn plan(&self, o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
        let style = Style {
            qk_norms: true,
            qkv_biases: false,
            ffn_norm: "ffn_norm",
        };
        llama::plan(o, fallbacks, &style, &|_| Vec::new())
    }
}
