//! `gen --arch llama` (llama.cpp's `src/models/llama.cpp` with experts: Mixtral): the llama-style
//! file without q/k norms or biases, the routed experts stacked, and `feed_forward_length`
//! stating the experts' width (Mixtral states none of its own; llama.cpp sizes the experts by
//! it).

use super::llama::{self, Style};
use super::{Fallbacks, Family, GenError, GenOptions, ModelShape, Planned};
use crate::gguf::Value;

pub(super) struct LlamaMoe;

impl Family for LlamaMoe {
    fn validate(&self, s: &ModelShape) -> Result<(), String> {
        if s.n_ff_shexp != 0 {
            return Err("--shared-ffn: llama's Mixtral has no shared expert".into());
        }
        Ok(())
    }

    fn metadata(&self, o: &GenOptions) -> Result<Vec<(String, Value)>, GenError> {
        let s = &o.shape;
        let mut m = llama::metadata(o, s.n_ff_exp);
        m.push(("llama.rope.dimension_count".into(), Value::U32(s.head_dim)));
        Ok(m)
    }

    fn plan(&self, o: &GenOptions, fallbacks: &mut Fallbacks) -> Result<Vec<Planned>, GenError> {
        let style = Style {
            qk_norms: false,
            qkv_biases: false,
            ffn_norm: "ffn_norm",
        };
        llama::plan(o, fallbacks, &style, &|_| Vec::new())
    }
}
