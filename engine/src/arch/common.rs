//! What every family has, held once: the dimensions, the gating, the dense weights' map, the
//! embedding and head, each layer's memory and routed experts (router, its bias where the
//! family has one, the stacked projections), and the experts' gated activation. [`super::Arch`]
//! reads it through `common()`, and its default methods — the accessors, the router's logits,
//! one expert, the residual add, the head — are written here once; a family overrides only
//! what it does its own way (gemma4's soft-capped head and normed combination, qwen2moe's
//! shared expert in the combination).

use super::blocks::{self, Compute, Glu};
use super::layers::{add_rows, norm_head, split_ffn_biased};
use super::state::{LayerMemory, Scratch, State};
use super::weights::{ExpertTensor, Mat, Weights};
use super::{gate_up_down, Arch, ArchError, Dims, ExpertIn};
use crate::kernels::ActBuf;
use bmoe_core::Gating;

/// A family's shared part (see the module docs).
pub struct Common {
    /// `general.architecture`.
    pub name: &'static str,
    pub dims: Dims,
    pub gating: Gating,
    pub weights: Weights,
    pub embd: Mat,
    /// The output head (the embedding again where the file ties them).
    pub output: Mat,
    pub output_norm: Vec<f32>,
    pub rms_eps: f32,
    /// The routed experts' FFN width.
    pub n_ff_exp: usize,
    /// The routed experts' gated activation: `down(glu(gate·x, up·x))`.
    pub glu: Glu,
    /// Per model layer.
    pub layers: Vec<CommonLayer>,
}

/// One model layer's shared part.
pub struct CommonLayer {
    /// What the layer remembers between steps.
    pub memory: LayerMemory,
    /// Its routed experts; `None` for a dense layer.
    pub moe: Option<Experts>,
}

/// One MoE layer's router and routed experts.
pub struct Experts {
    /// `ffn_gate_inp`: the router's logits of one row.
    pub router: Mat,
    /// `ffn_gate_inp.bias`, added to the logits (gpt-oss).
    pub router_bias: Option<Vec<f32>>,
    /// The stacked projections in read order: gate, up, down; or a fused gate_up (the gate's
    /// rows first) and down.
    pub exps: Vec<ExpertTensor>,
}

impl Common {
    /// Layer `layer`'s experts, or an error naming a dense layer (or one out of range).
    pub fn experts(&self, layer: usize) -> Result<&Experts, ArchError> {
        self.layers
            .get(layer)
            .and_then(|l| l.moe.as_ref())
            .ok_or_else(|| ArchError::Tensor {
                file: String::new(),
                tensor: format!("blk.{layer}.ffn_gate_inp"),
                what: format!(
                    "is not there: layer {layer} of {} has no routed experts",
                    self.layers.len()
                ),
            })
    }
}

/// [`Arch::router_logits`] of every family: `ffn_gate_inp · x` (+ its bias where there is one).
pub fn router_logits(
    c: &Common,
    cx: &Compute,
    layer: usize,
    input: &[f32],
    rows: usize,
    acts: &mut Vec<ActBuf>,
    out: &mut [f32],
) -> Result<(), ArchError> {
    let moe = c.experts(layer)?;
    cx.mat_rows(&moe.router, input, rows, acts, out)?;
    if let Some(b) = &moe.router_bias {
        blocks::add_bias(&mut out[..rows * c.dims.n_expert], b);
    }
    Ok(())
}

/// [`Arch::expert`] of every family: the split gated FFN of the expert's gate, up and down
/// ([`gate_up_down`] of its projections), with [`Arch::expert_bias`]'s biases, then
/// [`Arch::expert_scale`]'s scale — exactly what [`super::Model::experts_together`] computes
/// for a layer whose [`Arch::split_glu`] is set.
#[allow(clippy::too_many_arguments)]
pub fn expert<A: Arch + ?Sized>(
    a: &A,
    cx: &Compute,
    s: &mut Scratch,
    layer: usize,
    expert: usize,
    proj: &[&[u8]],
    input: &ExpertIn<'_>,
    out: &mut Vec<f32>,
) -> Result<(), ArchError> {
    let c = a.common();
    let moe = c.experts(layer)?;
    let (n, d) = (input.n, c.dims.d_model);
    if expert >= c.dims.n_expert {
        return Err(ArchError::Tensor {
            file: String::new(),
            tensor: format!("blk.{layer} experts"),
            what: format!("expert {expert} of {}", c.dims.n_expert),
        });
    }
    let types = match &moe.exps[..] {
        [gu, dn] => Some([gu.info.ty, gu.info.ty, dn.info.ty]),
        [g, u, dn] => Some([g.info.ty, u.info.ty, dn.info.ty]),
        _ => None,
    };
    let (Some(ty), Some([g, u, dn])) = (types, gate_up_down(proj)) else {
        return Err(ArchError::Tensor {
            file: String::new(),
            tensor: format!("blk.{layer} experts"),
            what: format!(
                "{} projections given for {} tensors: {} experts are [gate, up, down] or \
                 [gate_up, down]",
                proj.len(),
                moe.exps.len(),
                c.name
            ),
        });
    };
    split_ffn_biased(
        cx,
        s,
        a.split_glu(layer).unwrap_or(c.glu),
        (ty[0], g),
        (ty[1], u),
        (ty[2], dn),
        a.expert_bias(layer, expert),
        c.n_ff_exp,
        d,
        input.rows,
        n,
        input.prepared,
        out,
    )?;
    if let Some(f) = a.expert_scale(layer, expert) {
        out[..n * d].iter_mut().for_each(|v| *v *= f);
    }
    Ok(())
}

/// [`Arch::finish_layer`] of the families whose experts' sum is the layer's whole FFN: the
/// residual add of `st.moe_out`.
pub fn finish_layer(c: &Common, st: &mut State) {
    add_rows(&mut st.x, c.dims.d_model, &st.ffn_rows, &st.moe_out);
}

/// [`Arch::head`] of every family: the final RMS norm and the output head.
pub fn head(c: &Common, cx: &Compute, st: &mut State) -> Result<(), ArchError> {
    norm_head(cx, st, &c.output_norm, &c.output, c.rms_eps)
}
