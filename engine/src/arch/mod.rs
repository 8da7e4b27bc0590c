//! One file per architecture over shared building blocks, and the seam between them and the
//! engine.
//!
//! An architecture (`qwen3moe.rs`, …) reads and checks its hyper-parameters from GGUF metadata
//! once, names its tensors verbatim, and says how one layer composes the blocks of
//! [`blocks`] — so it reads like llama.cpp's `src/models/<arch>.cpp`. It implements [`Arch`]:
//! the dense step of a layer (attention, norms, any resident FFN), the router's logits, one
//! expert's FFN, and what finishes a MoE layer and the model. [`Model`] drives any `Arch`
//! through the steps the core's decode step calls, doing what every family shares once: the
//! batch's rows, the gating (`bmoe_core::Gating`: selection and weights), the experts'
//! weighted outputs in rank order, prediction. [`REGISTRY`] maps `general.architecture` to a
//! loader; an unknown architecture is refused by name.

pub mod bailingmoe3;
pub mod blocks;
pub mod common;
pub mod deepseek2;
pub mod deepseek4;
pub mod delta;
pub mod gemma4;
pub mod gpt_oss;
pub mod layers;
pub mod lfm2moe;
pub mod llama;
pub mod meta;
pub mod mla;
pub mod qwen2moe;
pub mod qwen35moe;
pub mod qwen3moe;
pub mod state;
pub mod weights;

use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use crate::kernels::{self, ActBuf};
use blocks::Compute;
use bmoe_core::Gating;
pub use common::{Common, CommonLayer, Experts};
pub use state::{
    AttnBufs, ExpertBufs, KvSnapshot, LayerMemory, Memory, MemoryKind, Prediction, RecurrentLayer,
    RecurrentShape, Scratch, State,
};
use std::sync::Arc;
pub use weights::{ExpertTensor, Loader, Mat, Weights};

/// Errors loading or running a model of an architecture.
#[derive(Debug, thiserror::Error)]
pub enum ArchError {
    #[error("{file}: architecture '{arch}' is not one this build runs (supported: {supported}); see --list-archs")]
    Unsupported {
        file: String,
        arch: String,
        supported: String,
    },
    #[error("{file}: architecture '{arch}' is not a mixture-of-experts model; bmoe streams MoE experts only")]
    NotMoe { file: String, arch: String },
    #[error("{file}: metadata key '{key}' {what}")]
    Key {
        file: String,
        key: String,
        what: String,
    },
    #[error("{file}: tensor '{tensor}' {what}")]
    Tensor {
        file: String,
        tensor: String,
        what: String,
    },
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    /// `--check-finite` found a NaN or infinity in a layer's intermediate (named as
    /// llama.cpp's eval callback names them).
    #[error("layer {layer} {tensor}: {count} of {total} values are NaN or infinite (first at position {position}); this is the first intermediate --check-finite found broken")]
    NonFinite {
        layer: usize,
        tensor: &'static str,
        position: u32,
        count: usize,
        total: usize,
    },
}

/// The shape every family reports.
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    pub n_layer: usize,
    /// Routed experts per MoE layer.
    pub n_expert: usize,
    /// Experts the router keeps per token (`expert_used_count`).
    pub n_expert_used: usize,
    pub d_model: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
}

/// One MoE layer's routed experts as the file stores them: the model layer and its stacked
/// projections in read order (gate, up, down; or a fused gate_up and down).
pub struct MoeLayer<'a> {
    pub layer: usize,
    pub projections: &'a [ExpertTensor],
}

/// An architecture: its hyper-parameters and tensors, and how one layer composes the blocks.
///
/// The steps are called by [`Model`] in the decode step's order: `dense(l)` for every layer;
/// for a MoE layer then the router (`router_logits` on the input `dense` left), any number of
/// `expert` calls, and `finish_layer(l)` once [`Model`] summed the experts' weighted outputs
/// in rank order into `State::moe_out`; finally `head`. Errors stop the step.
///
/// A family holds what every family has in a [`Common`] (`common()`); the default methods
/// read it, so a family file writes its hyper-parameters, its loader and `dense`, and
/// overrides only what it computes its own way.
pub trait Arch: Send + Sync {
    /// The family's shared part.
    fn common(&self) -> &Common;
    /// `general.architecture`.
    fn name(&self) -> &'static str {
        self.common().name
    }
    fn dims(&self) -> &Dims {
        &self.common().dims
    }
    /// How the router selects and weights its experts.
    fn gating(&self) -> Gating {
        self.common().gating
    }
    /// The dense side (the file, the dense bytes per layer, their address ranges).
    fn weights(&self) -> &Weights {
        &self.common().weights
    }
    /// The MoE layers in model order.
    fn moe_layers(&self) -> Vec<MoeLayer<'_>> {
        self.common()
            .layers
            .iter()
            .enumerate()
            .filter_map(|(layer, l)| {
                l.moe.as_ref().map(|m| MoeLayer {
                    layer,
                    projections: &m.exps,
                })
            })
            .collect()
    }
    /// What model layer `layer` remembers between steps.
    fn memory(&self, layer: usize) -> LayerMemory {
        self.common().layers[layer].memory
    }
    /// The token embedding matrix.
    fn token_embd(&self) -> &Mat {
        &self.common().embd
    }
    /// A factor the embedded rows are multiplied by (gemma: √d_model).
    fn embed_scale(&self) -> Option<f32> {
        None
    }
    /// Everything of layer `layer` that is not routed experts, over `st.x` (every batch row).
    /// For a MoE layer it leaves the experts' input in `st.h` (and the router's in
    /// `st.router_in` with `st.router_separate` when they differ), one row per `st.ffn_rows`;
    /// a dense layer finishes itself.
    fn dense(&self, cx: &Compute, st: &mut State, layer: usize) -> Result<(), ArchError>;
    /// The router's logits of layer `layer` for `rows` rows of router input:
    /// `ffn_gate_inp · x`, plus its bias where the family has one ([`common::router_logits`]).
    fn router_logits(
        &self,
        cx: &Compute,
        layer: usize,
        input: &[f32],
        rows: usize,
        acts: &mut Vec<ActBuf>,
        out: &mut [f32],
    ) -> Result<(), ArchError> {
        common::router_logits(self.common(), cx, layer, input, rows, acts, out)
    }
    /// A per-expert bias added for selection only (sigmoid gating); none by default.
    fn selection_bias(&self, _layer: usize) -> Option<&[f32]> {
        None
    }
    /// The experts layer `layer` routes token `token` to whatever its router scores
    /// (deepseek4's hash layers: a table by token id), in rank order; the router's scores
    /// still weigh them. `None` (the default): the router selects.
    fn fixed_experts(&self, _layer: usize, _token: u32) -> Option<&[u32]> {
        None
    }
    /// Expert `expert` of layer `layer` on the input rows of `input`, its projections' bytes
    /// in `proj` (read order); the unweighted output rows into `out`. By default the split
    /// gated FFN with the family's activation, biases and scale ([`common::expert`]).
    #[allow(clippy::too_many_arguments)]
    fn expert(
        &self,
        cx: &Compute,
        scratch: &mut Scratch,
        layer: usize,
        expert: usize,
        proj: &[&[u8]],
        input: &ExpertIn<'_>,
        out: &mut Vec<f32>,
    ) -> Result<(), ArchError> {
        common::expert(self, cx, scratch, layer, expert, proj, input, out)
    }
    /// The activation of layer `layer`'s experts when each one is exactly
    /// `s · (down(glu(gate·x + bg, up·x + bu)) + bd)` over its three projections (gate, up,
    /// down), or over two (a fused gate_up whose first half of rows is the gate, and down;
    /// [`gate_up_down`]) — the biases those of [`Arch::expert_bias`] or none, the scale `s`
    /// [`Arch::expert_scale`]'s or 1 — computed as the split FFN computes it on the layer's
    /// prepared rows, which lets [`Model::experts_together`] run a layer's experts together.
    /// By default the family's activation on every MoE layer (the default [`Arch::expert`]
    /// computes exactly that); `None` computes every expert through [`Arch::expert`].
    fn split_glu(&self, layer: usize) -> Option<blocks::Glu> {
        let c = self.common();
        c.layers
            .get(layer)
            .and_then(|l| l.moe.as_ref())
            .map(|_| c.glu)
    }
    /// Expert `expert`'s biases in a layer of [`Arch::split_glu`] experts that have them
    /// (gpt-oss); none by default.
    fn expert_bias(&self, _layer: usize, _expert: usize) -> Option<layers::FfnBias<'_>> {
        None
    }
    /// Expert `expert`'s output scale in a layer of [`Arch::split_glu`] experts that have one
    /// (gemma4's `ffn_down_exps.scale`); none by default.
    fn expert_scale(&self, _layer: usize, _expert: usize) -> Option<f32> {
        None
    }
    /// Combine `st.moe_out` (and anything `dense` left in `st.side`) into the residual stream.
    /// By default the residual add of the experts' sum.
    fn finish_layer(&self, _cx: &Compute, st: &mut State, _layer: usize) -> Result<(), ArchError> {
        common::finish_layer(self.common(), st);
        Ok(())
    }
    /// Whether a batch may hold rows of several sequences (`State::groups`): true where every
    /// layer's memory is reached through `layers::attend_layer` alone, which attends each run
    /// of rows over its own sequence's memory. False (the default) for families with a
    /// recurrent state, a latent or compressed memory, or their own attention loop.
    fn batches_sequences(&self) -> bool {
        false
    }
    /// Final norm and output head for `st.out_rows` into `st.logits`.
    fn head(&self, cx: &Compute, st: &mut State) -> Result<(), ArchError> {
        common::head(self.common(), cx, st)
    }
    /// The memory of the model's MTP (next-token prediction) head, a layer at index
    /// `n_layer`, when the file has one this build runs; `None` by default.
    fn mtp_memory(&self) -> Option<LayerMemory> {
        None
    }
    /// The MTP head on `tokens` at `positions`, each row paired with `h` (`n × d_model`): the
    /// normed final hidden state (the head's input, llama.cpp's `h_nextn`) of the position
    /// before it. `st` is the head's own state ([`Model::new_mtp_state`]): its attention
    /// memory takes every row's keys and values. For `st.out_rows` the head's own normed
    /// hidden lands in `h_out` (what the next draft step takes as its `h`) and its logits in
    /// `st.logits`. Only called where [`Arch::mtp_memory`] is `Some`.
    fn mtp_forward(
        &self,
        _cx: &Compute,
        _st: &mut State,
        _tokens: &[u32],
        _h: &[f32],
        _h_out: &mut Vec<f32>,
    ) -> Result<(), ArchError> {
        Err(ArchError::Key {
            file: String::new(),
            key: "nextn_predict_layers".into(),
            what: format!("{} has no MTP head this build runs", self.name()),
        })
    }
}

/// One expert's projections in read order as (gate, up, down): three as they are; two — a
/// fused gate_up whose first half of rows is the gate, and down — with the fused one split at
/// its middle row (every row of a tensor is the same number of bytes). `None` for any other
/// count, or a fused slice of odd length.
pub fn gate_up_down<'a>(proj: &[&'a [u8]]) -> Option<[&'a [u8]; 3]> {
    match *proj {
        [g, u, d] => Some([g, u, d]),
        [gu, d] if gu.len() % 2 == 0 => {
            let (g, u) = gu.split_at(gu.len() / 2);
            Some([g, u, d])
        }
        _ => None,
    }
}

/// The rows an expert runs on.
pub struct ExpertIn<'a> {
    /// `n × d_model` values: the experts' input (`State::h`) of the FFN rows routed to it.
    pub rows: &'a [f32],
    pub n: usize,
    /// The same rows quantised once per layer by the driver for the weights type of the
    /// layer's first expert projection (which reads the experts' input), shared by every
    /// expert a row is routed to; empty when the driver did not prepare them. An
    /// architecture uses them for a projection of `rows` whose activation format they have
    /// ([`crate::kernels::ActBuf::format`]) and quantises `rows` itself otherwise.
    pub prepared: &'a [&'a ActBuf],
}

/// One routed expert of a layer and the rows routed to it, for [`Model::experts_together`].
pub struct ExpertJob<'a> {
    pub expert: usize,
    /// The expert's gate, up and down bytes ([`gate_up_down`] of its projections).
    pub proj: [&'a [u8]; 3],
    /// (FFN row index, rank, weight) of each row routed to it, as [`Model::expert`] takes them.
    pub uses: &'a [(u32, u16, f32)],
}

/// An architecture's loader: check and map `file`'s tensors, applying a dense mode.
pub type LoadFn = fn(Arc<GgufFile>, DenseMode) -> Result<Box<dyn Arch>, ArchError>;

/// A registered architecture.
pub struct ArchEntry {
    pub name: &'static str,
    /// One line for `--list-archs`.
    pub about: &'static str,
    pub load: LoadFn,
}

/// Architectures this build runs, keyed by `general.architecture`.
pub const REGISTRY: &[ArchEntry] = &[
    ArchEntry {
        name: qwen3moe::ARCH,
        about: "Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax top-k routing, renormalised, SiLU-gated split experts, no shared expert",
        load: qwen3moe::load,
    },
    ArchEntry {
        name: qwen2moe::ARCH,
        about: "Qwen1.5/Qwen2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): softmax top-k routing, not renormalised, SiLU-gated split experts, a sigmoid-gated shared expert (resident)",
        load: qwen2moe::load,
    },
    ArchEntry {
        name: qwen35moe::ARCH,
        about: "Qwen3.5/3.6 MoE (Qwen3.6-35B-A3B): Gated DeltaNet layers (recurrent state) with gated full attention every 4th, softmax top-k routing (renormalised), SiLU-gated experts, a sigmoid-gated shared expert (resident), an MTP block that drafts for --mtp",
        load: qwen35moe::load,
    },
    ArchEntry {
        name: gemma4::ARCH,
        about: "Gemma 4 MoE (Gemma-4-26B-A4B): a dense GELU MLP beside GELU-gated fused gate_up experts with per-expert down scales, softmax top-k routing (renormalised) on its own scaled input, sliding-window and global layers, logit soft-capping",
        load: gemma4::load,
    },
    ArchEntry {
        name: gpt_oss::ARCH,
        about: "gpt-oss (gpt-oss-20b, gpt-oss-120b): top-k on the raw router logits (biased), softmax over the k, clamped-SwiGLU experts with per-expert biases, attention sinks, sliding-window layers on a ring KV",
        load: gpt_oss::load,
    },
    ArchEntry {
        name: deepseek2::ARCH,
        about: "DeepSeek-V2/V2-Lite, Moonlight (deepseek2): multi-head latent attention (absorbed; a latent row per position kept, not K/V), YaRN, leading dense layers, softmax or sigmoid top-k routing with shared experts (resident)",
        load: deepseek2::load,
    },
    ArchEntry {
        name: llama::ARCH,
        about: "llama with routed experts (Mixtral-8x7B, 8x22B): GQA with the original rotary embedding, softmax top-k routing (renormalised), SiLU-gated experts; a dense llama file is refused",
        load: llama::load,
    },
    ArchEntry {
        name: lfm2moe::ARCH,
        about: "LFM2 MoE (LFM2-8B-A1B): short-convolution layers (a recurrent window) and GQA attention layers, leading dense FFN layers, sigmoid routing selected with a per-expert bias and renormalised without it, SiLU-gated split experts",
        load: lfm2moe::load,
    },
    ArchEntry {
        name: bailingmoe3::ARCH,
        about: "Ling/Ring 3.0 (bailingmoe3): recurrent Kimi Delta Attention layers (per-channel gated delta rule) and gated multi-head latent attention layers, leading dense layers, sigmoid top-k routing selected with a per-expert bias beside a shared expert (resident)",
        load: bailingmoe3::load,
    },
    ArchEntry {
        name: deepseek4::ARCH,
        about: "DeepSeek V4 (deepseek4): four hyper-connection residual streams mixed by Sinkhorn, single-key-head attention over a sliding window plus compressed KV rows (every 128 positions, or every 4 chosen by a lightning indexer), sqrt-softplus top-k routing with a selection bias and hash-routed first layers, a shared expert (resident), clamped SwiGLU",
        load: deepseek4::load,
    },
];

/// The registered names, comma-separated.
pub fn supported() -> String {
    REGISTRY
        .iter()
        .map(|e| e.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether this build runs architecture `name`.
pub fn is_supported(name: &str) -> bool {
    REGISTRY.iter().any(|e| e.name == name)
}

/// Load `file` as the architecture its `general.architecture` names, applying `mode` to the
/// dense matrices. An architecture this build does not run is refused by name.
pub fn load(file: Arc<GgufFile>, mode: DenseMode) -> Result<Box<dyn Arch>, ArchError> {
    let path = file.path().display().to_string();
    let Some(name) = file.architecture() else {
        return Err(ArchError::Key {
            file: path,
            key: "general.architecture".into(),
            what: "is missing".into(),
        });
    };
    match REGISTRY.iter().find(|e| e.name == name) {
        Some(e) => (e.load)(file, mode),
        None => Err(ArchError::Unsupported {
            file: path,
            arch: name.into(),
            supported: supported(),
        }),
    }
}

/// Bytes of every layer's keys and values at a context of `n_ctx`: what a state commits once
/// its context is full.
pub fn kv_bytes(arch: &dyn Arch, n_ctx: usize) -> u64 {
    (0..arch.dims().n_layer)
        .map(|l| arch.memory(l).bytes(n_ctx))
        .sum()
}

/// The router's choice for the rows of one layer.
#[derive(Clone, Debug, Default)]
pub struct RouteOut {
    /// Rows of the batch this layer routes (all, or the output rows at the last layer).
    pub rows: Vec<u32>,
    pub k: usize,
    /// `rows.len() × k` expert ids, rank order.
    pub ids: Vec<u32>,
    /// `rows.len() × k` final weights.
    pub weights: Vec<f32>,
    /// `rows.len() × n_expert` router scores in the gating's space (softmax probabilities;
    /// gpt-oss: the raw logits), for the hooks that re-rank.
    pub probs: Vec<f32>,
}

/// An architecture bound to a compute pool: the forward pass in the decode step's steps.
/// Generic over the architecture (`Model<Qwen3Moe>` for one family, `Model` = `Model<dyn
/// Arch>` for whichever the file names).
pub struct Model<A: Arch + ?Sized = dyn Arch> {
    pub cx: Compute,
    /// Experts the router keeps per token: the model's `expert_used_count`, or fewer by
    /// `set_top_k`. `bmoe-cli` leaves it whole and narrows `--n-expert-used` in the core's
    /// router hook, resident and streamed alike (same gating, same bits).
    top_k: usize,
    gating: Gating,
    /// `--check-finite`: stop at the first layer intermediate holding a NaN or infinity.
    check_finite: bool,
    dims: Dims,
    /// Per model layer: its experts' projections (empty for a dense layer).
    experts: Vec<Vec<ExpertTensor>>,
    pub arch: Box<A>,
}

impl<A: Arch + ?Sized> Model<A> {
    pub fn new(arch: Box<A>, threads: usize) -> Model<A> {
        let dims = arch.dims().clone();
        let mut experts = vec![Vec::new(); dims.n_layer];
        for m in arch.moe_layers() {
            experts[m.layer] = m.projections.to_vec();
        }
        Model {
            cx: Compute::new(threads),
            top_k: dims.n_expert_used,
            gating: arch.gating(),
            check_finite: false,
            dims,
            experts,
            arch,
        }
    }

    /// Keep only the top `k` experts per token (1..=the model's `expert_used_count`).
    pub fn set_top_k(&mut self, k: usize) {
        self.top_k = k.clamp(1, self.dims.n_expert_used);
    }

    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    /// Check every layer's intermediates for NaN and infinity (`--check-finite`): one pass
    /// over the hidden state per check, to name the first layer and tensor that breaks.
    pub fn set_check_finite(&mut self, on: bool) {
        self.check_finite = on;
    }

    /// Under `--check-finite`, an error when `data` (rows of `row_len` values; row `i` is
    /// batch row `rows[i]`, or `i` when `rows` is `None`) holds a non-finite value.
    fn check(
        &self,
        st: &State,
        layer: usize,
        tensor: &'static str,
        data: &[f32],
        row_len: usize,
        rows: Option<&[u32]>,
    ) -> Result<(), ArchError> {
        if !self.check_finite {
            return Ok(());
        }
        let Some((count, first)) = crate::finite::non_finite(data) else {
            return Ok(());
        };
        let row = first / row_len.max(1);
        let batch_row = rows.map_or(row, |r| r.get(row).copied().unwrap_or(0) as usize);
        Err(ArchError::NonFinite {
            layer,
            tensor,
            position: st.positions.get(batch_row).copied().unwrap_or(0),
            count,
            total: data.len(),
        })
    }

    /// `--check-finite` on the FFN rows' residual stream after layer `layer` (`l_out`).
    fn check_l_out(&self, st: &State, layer: usize) -> Result<(), ArchError> {
        if !self.check_finite {
            return Ok(());
        }
        let d = self.dims.d_model;
        for &row in &st.ffn_rows {
            let r = row as usize;
            self.check(
                st,
                layer,
                "l_out",
                &st.x[r * d..(r + 1) * d],
                d,
                Some(&[row]),
            )?;
        }
        Ok(())
    }

    pub fn gating(&self) -> Gating {
        self.gating
    }

    /// Model layer `layer`'s expert projections (empty for a dense layer).
    pub fn experts(&self, layer: usize) -> &[ExpertTensor] {
        self.experts.get(layer).map(|v| &v[..]).unwrap_or(&[])
    }

    /// The state of the MTP head (the memory of its layer at index `n_layer`; nothing for
    /// the trunk's), when the model has one.
    pub fn new_mtp_state(&self, n_ctx: usize) -> Option<State> {
        let head = self.arch.mtp_memory()?;
        let mut mem = vec![LayerMemory::None; self.dims.n_layer];
        mem.push(head);
        Some(State::new(&mem, n_ctx))
    }

    /// The MTP head ([`Arch::mtp_forward`]) on `tokens` at `positions` with the previous
    /// positions' hidden states `h`; `out_rows` are the rows whose logits (into `st.logits`)
    /// and head hidden state (into `h_out`) are wanted.
    pub fn mtp(
        &self,
        st: &mut State,
        tokens: &[u32],
        positions: &[u32],
        h: &[f32],
        out_rows: &[u32],
        h_out: &mut Vec<f32>,
    ) -> Result<(), ArchError> {
        let (n, d) = (tokens.len(), self.dims.d_model);
        let bad = |what: String| ArchError::Key {
            file: String::new(),
            key: "MTP head input".into(),
            what,
        };
        if positions.len() != n || h.len() != n * d {
            return Err(bad(format!(
                "{n} tokens, {} positions and {} hidden values (d_model {d})",
                positions.len(),
                h.len()
            )));
        }
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= st.n_ctx) {
            return Err(bad(format!(
                "position {p} is past the context size {}",
                st.n_ctx
            )));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.dims.n_vocab) {
            return Err(bad(format!("token {t} is outside the vocabulary")));
        }
        st.n_rows = n;
        st.positions.clear();
        st.positions.extend_from_slice(positions);
        st.tokens.clear();
        st.tokens.extend_from_slice(tokens);
        st.out_rows.clear();
        st.out_rows.extend_from_slice(out_rows);
        self.arch.mtp_forward(&self.cx, st, tokens, h, h_out)
    }

    pub fn new_state(&self, n_ctx: usize) -> State {
        let mem: Vec<LayerMemory> = (0..self.dims.n_layer)
            .map(|l| self.arch.memory(l))
            .collect();
        State::new(&mem, n_ctx)
    }

    /// Start a batch: embed `tokens` at `positions`; `out_rows` are the rows whose logits
    /// `head` will produce (the last row for generation; all rows for `--logits-out`).
    pub fn begin(
        &self,
        st: &mut State,
        tokens: &[u32],
        positions: &[u32],
        out_rows: &[u32],
    ) -> Result<(), ArchError> {
        let d = self.dims.d_model;
        let n = tokens.len();
        if let Some(&p) = positions.iter().max() {
            if p as usize >= st.n_ctx {
                return Err(ArchError::Key {
                    file: String::new(),
                    key: "n_ctx".into(),
                    what: format!("position {p} is past the context size {}", st.n_ctx),
                });
            }
        }
        st.n_rows = n;
        st.pred.layer = None;
        st.router_margin.clear();
        st.router_margin.resize(n, f32::INFINITY);
        st.positions.clear();
        st.positions.extend_from_slice(positions);
        st.tokens.clear();
        st.tokens.extend_from_slice(tokens);
        st.out_rows.clear();
        st.out_rows.extend_from_slice(out_rows);
        st.x.resize(n * d, 0.0);
        let embd = self.arch.token_embd();
        for (r, &t) in tokens.iter().enumerate() {
            if t as usize >= self.dims.n_vocab {
                return Err(ArchError::Key {
                    file: String::new(),
                    key: "token".into(),
                    what: format!("id {t} is outside the vocabulary of {}", self.dims.n_vocab),
                });
            }
            embd.row_f32(t as usize, &mut st.x[r * d..(r + 1) * d])?;
        }
        if let Some(s) = self.arch.embed_scale() {
            st.x.iter_mut().for_each(|v| *v *= s);
        }
        self.check(st, 0, "inp_embd", &st.x, d, None)
    }

    /// Layer `layer`'s dense step. The FFN runs for every row, except at the last layer where
    /// only the rows whose logits are wanted matter (as llama.cpp gathers `inp_out_ids`).
    pub fn dense(&self, st: &mut State, layer: usize) -> Result<(), ArchError> {
        st.ffn_rows.clear();
        if layer + 1 == self.dims.n_layer && !st.every_row_out {
            st.ffn_rows.extend_from_slice(&st.out_rows);
        } else {
            st.ffn_rows.extend(0..st.n_rows as u32);
        }
        st.router_separate = false;
        // `dense` rewrites the experts' input: its quantised rows are stale.
        st.experts.h_acts_for = None;
        self.arch.dense(&self.cx, st, layer)?;
        if self.experts(layer).is_empty() {
            // A dense layer finished itself.
            return self.check_l_out(st, layer);
        }
        let (m, k, d) = (
            st.ffn_rows.len(),
            self.dims.n_expert_used,
            self.dims.d_model,
        );
        st.experts.k = k;
        st.experts.per_rank.resize(m * k * d, 0.0);
        st.experts.filled.clear();
        st.experts.filled.resize(m * k, false);
        self.check(st, layer, "ffn_inp", &st.x, d, None)?;
        self.check(st, layer, "ffn_norm", &st.h, d, Some(&st.ffn_rows))
    }

    /// The router of MoE layer `layer`: logits, the gating's scores, selection and weights.
    /// Rows of `out` are indices into the FFN rows of this layer (see [`RouteOut::rows`]).
    pub fn route(&self, st: &mut State, layer: usize, out: &mut RouteOut) -> Result<(), ArchError> {
        let m = st.ffn_rows.len();
        let (ne, d) = (self.dims.n_expert, self.dims.d_model);
        let k = self.top_k;
        out.rows.clear();
        out.rows.extend_from_slice(&st.ffn_rows);
        out.k = k;
        out.probs.resize(m * ne, 0.0);
        let input = if st.router_separate {
            &st.router_in
        } else {
            &st.h
        };
        let r = self.arch.router_logits(
            &self.cx,
            layer,
            input,
            m,
            &mut st.scratch.acts,
            &mut out.probs,
        );
        // Keep the last row's router input for `predict` (a later layer's router on it).
        st.pred.input.clear();
        if m > 0 {
            st.pred.input.extend_from_slice(&input[(m - 1) * d..m * d]);
            st.pred.layer = Some(layer);
        } else {
            st.pred.layer = None;
        }
        r?;
        self.check(
            st,
            layer,
            "ffn_moe_logits",
            &out.probs,
            ne,
            Some(&st.ffn_rows),
        )?;
        out.ids.resize(m * k, 0);
        out.weights.resize(m * k, 0.0);
        let bias = self.arch.selection_bias(layer);
        let order = &mut st.pred.order;
        for r in 0..m {
            let scores = &mut out.probs[r * ne..(r + 1) * ne];
            self.gating.scores_in_place(scores);
            let row = st.ffn_rows.get(r).map_or(r, |&x| x as usize);
            let token = st.tokens.get(row).copied().unwrap_or(0);
            if let Some(fixed) = self.arch.fixed_experts(layer, token) {
                // A hash layer: no choice, so no margin.
                let (ids, w) = (
                    &mut out.ids[r * k..(r + 1) * k],
                    &mut out.weights[r * k..(r + 1) * k],
                );
                ids.copy_from_slice(&fixed[..k]);
                self.gating.weights_for(scores, ids, w);
                continue;
            }
            self.gating.select(
                scores,
                bias,
                order,
                &mut out.ids[r * k..(r + 1) * k],
                &mut out.weights[r * k..(r + 1) * k],
            );
            // `order` is every expert by ranking score: the margin is the last chosen one's
            // lead over the first left out.
            if k > 0 && k < order.len() {
                let rank = |e: u32| {
                    let b = bias.and_then(|b| b.get(e as usize)).copied().unwrap_or(0.0);
                    self.gating.rank_score(scores[e as usize], b)
                };
                let margin = rank(order[k - 1]) - rank(order[k]);
                if let Some(slot) = st.router_margin.get_mut(row) {
                    *slot = slot.min(margin);
                }
            }
        }
        Ok(())
    }

    /// Expert prediction: layer `target`'s router applied to the router input of layer `from`
    /// (the last row `route(from)` routed), top-`k` ids and their weights written to `ids` /
    /// `weights` — the very arithmetic of `route` (same product, same gating), so `from ==
    /// target` reproduces the router bit for bit. `Ok(false)` when `from` is not the layer
    /// routed last in this batch, `target` is not a MoE layer, or `k` is not in
    /// `1..=n_expert`.
    pub fn predict(
        &self,
        st: &mut State,
        from: usize,
        target: usize,
        k: usize,
        ids: &mut Vec<u32>,
        weights: &mut Vec<f32>,
    ) -> Result<bool, ArchError> {
        let ne = self.dims.n_expert;
        ids.clear();
        weights.clear();
        if st.pred.layer != Some(from) || self.experts(target).is_empty() || k == 0 || k > ne {
            return Ok(false);
        }
        st.pred.scores.resize(ne, 0.0);
        self.arch.router_logits(
            &self.cx,
            target,
            &st.pred.input,
            1,
            &mut st.pred.acts,
            &mut st.pred.scores,
        )?;
        ids.resize(k, 0);
        weights.resize(k, 0.0);
        self.gating.scores_in_place(&mut st.pred.scores);
        // A hash layer's experts follow from the token (the batch's last, whose router input
        // `predict` reads).
        let token = st.tokens.last().copied().unwrap_or(0);
        if let Some(fixed) = self
            .arch
            .fixed_experts(target, token)
            .filter(|f| f.len() >= k)
        {
            ids.copy_from_slice(&fixed[..k]);
            self.gating.weights_for(&st.pred.scores, ids, weights);
            return Ok(true);
        }
        self.gating.select(
            &st.pred.scores,
            self.arch.selection_bias(target),
            &mut st.pred.order,
            ids,
            weights,
        );
        Ok(true)
    }

    /// One expert for the FFN rows routed to it. `uses` = (FFN row index, rank, weight);
    /// `proj` = the expert's projections' bytes in read order, wherever they live (map or
    /// arena). Each output row, weighted, lands in its (row, rank) slot.
    pub fn expert(
        &self,
        st: &mut State,
        layer: usize,
        expert: usize,
        proj: &[&[u8]],
        uses: &[(u32, u16, f32)],
    ) -> Result<(), ArchError> {
        let (d, k) = (self.dims.d_model, st.experts.k);
        let n = uses.len();
        if n == 0 {
            return Ok(());
        }
        let xs = self.experts(layer);
        if proj.len() != xs.len() {
            return Err(ArchError::Tensor {
                file: String::new(),
                tensor: format!("blk.{layer} experts"),
                what: format!("{} projections given, expected {}", proj.len(), xs.len()),
            });
        }
        check_slices(xs, proj)?;
        check_uses(layer, st.ffn_rows.len(), k, uses)?;
        self.prepare_h_acts(st, layer)?;
        let State {
            h,
            experts:
                ExpertBufs {
                    h_acts,
                    h_acts_for,
                    expert_in,
                    expert_out,
                    per_rank: moe,
                    filled: moe_filled,
                    ..
                },
            scratch,
            ..
        } = st;
        expert_in.resize(n * d, 0.0);
        let mut picked: Vec<&ActBuf> = Vec::with_capacity(n);
        for (i, &(row, _, _)) in uses.iter().enumerate() {
            let r = row as usize;
            expert_in[i * d..(i + 1) * d].copy_from_slice(&h[r * d..(r + 1) * d]);
            if h_acts_for.is_some() {
                picked.push(&h_acts[r]);
            }
        }
        let input = ExpertIn {
            rows: expert_in,
            n,
            prepared: &picked,
        };
        self.arch
            .expert(&self.cx, scratch, layer, expert, proj, &input, expert_out)?;
        drop(picked);
        place_weighted(moe, moe_filled, d, k, uses, expert_out);
        Ok(())
    }

    /// Every FFN row's input quantised once per layer for the first expert projection (a row
    /// is routed to k experts; in a batch, an expert serves many rows), the rows split across
    /// the pool; each expert takes its rows' activations by reference. The bits are those of
    /// quantising an expert's rows itself. Nothing when that projection has no activation
    /// format.
    fn prepare_h_acts(&self, st: &mut State, layer: usize) -> Result<(), ArchError> {
        let Some(x) = self.experts(layer).first() else {
            return Ok(());
        };
        let ty = x.info.ty;
        let fmt = kernels::ActFormat::for_weights(ty);
        if fmt.is_some() && st.experts.h_acts_for != fmt.map(|f| (layer, f)) {
            st.experts.h_acts_for = None;
            let (m, d) = (st.ffn_rows.len(), self.dims.d_model);
            blocks::prepare_acts(&self.cx.pool, ty, &st.h, m, d, &mut st.experts.h_acts)?;
            st.experts.h_acts_for = fmt.map(|f| (layer, f));
        }
        Ok(())
    }

    /// True when [`Model::experts_together`] runs layer `layer`'s experts in two rounds of the
    /// pool: they are split gated FFNs ([`Arch::split_glu`]) whose gate and up read one
    /// activation format.
    pub fn experts_batchable(&self, layer: usize) -> bool {
        self.arch.split_glu(layer).is_some() && self.glu_shape(layer).is_some()
    }

    /// The gate, up and down tensors' types of layer `layer`'s experts and their FFN width,
    /// when they are a split gated FFN ([`gate_up_down`]: three projections, or a fused
    /// gate_up of an even number of rows and a down) whose gate and up read one activation
    /// format.
    fn glu_shape(&self, layer: usize) -> Option<([crate::gguf::GgmlType; 3], usize)> {
        let xs = self.experts(layer);
        let (types, ff) = match xs {
            [g, u, d] => ([g.info.ty, u.info.ty, d.info.ty], g.rows),
            [gu, d] if gu.rows % 2 == 0 => ([gu.info.ty, gu.info.ty, d.info.ty], gu.rows / 2),
            _ => return None,
        };
        let fmt = kernels::ActFormat::for_weights;
        (fmt(types[0]).is_some() && fmt(types[0]) == fmt(types[1])).then_some((types, ff))
    }

    /// Expert `expert`'s gate, up and down bytes in layer `layer` as the map holds them
    /// (resident), for [`ExpertJob::proj`].
    pub fn resident_job_proj(&self, layer: usize, expert: usize) -> Option<[&[u8]; 3]> {
        let w = self.arch.weights();
        let b = |x: &ExpertTensor| w.expert_bytes(x, expert);
        match self.experts(layer) {
            [g, u, d] => Some([b(g), b(u), b(d)]),
            [gu, d] => gate_up_down(&[b(gu), b(d)]),
            _ => None,
        }
    }

    /// A layer's routed experts, all at once (a resident step defers them to the layer's end):
    /// every expert's gate and up in one round of the pool (each on its own rows' prepared
    /// inputs, taken by reference as [`Model::expert`] takes them), the activation, the down
    /// projections' inputs quantised in one more round (the rows split across the threads;
    /// decode's few rows on the caller), then every down in one more (each expert's biases,
    /// where it has them, added as [`Arch::expert`] adds them), and the weighted rows into
    /// their (row, rank) slots in one more (split by rows; decode's on the caller) — four
    /// hand-offs per layer instead of three per expert (two for decode). Each output row gets
    /// exactly the bits [`Model::expert`] gives it (the same kernels on the same rows and
    /// activations) and is summed in rank order by `finish_layer` as before. Where the layer is not [`Model::experts_batchable`] it computes the experts one
    /// by one through [`Model::expert`].
    ///
    /// A long prompt's experts go in groups of at most [`GROUP_USES`] rows (an expert with
    /// more is a group of its own), so the scratch stays bounded: a few rounds per group.
    pub fn experts_together(
        &self,
        st: &mut State,
        layer: usize,
        jobs: &[ExpertJob<'_>],
    ) -> Result<(), ArchError> {
        self.experts_in_groups(st, layer, jobs, GROUP_USES)
    }

    /// [`Model::experts_together`] in groups of at most `group_uses` rows.
    fn experts_in_groups(
        &self,
        st: &mut State,
        layer: usize,
        jobs: &[ExpertJob<'_>],
        group_uses: usize,
    ) -> Result<(), ArchError> {
        let glu = match self.arch.split_glu(layer) {
            Some(glu) if self.experts_batchable(layer) => glu,
            _ => {
                for j in jobs {
                    self.expert(st, layer, j.expert, &j.proj, j.uses)?;
                }
                return Ok(());
            }
        };
        let xs = self.experts(layer);
        let (k, m) = (st.experts.k, st.ffn_rows.len());
        for j in jobs {
            if j.expert >= self.dims.n_expert {
                return Err(ArchError::Tensor {
                    file: String::new(),
                    tensor: format!("blk.{layer} experts"),
                    what: format!("expert {} of {}", j.expert, self.dims.n_expert),
                });
            }
            if let [gu, d] = xs {
                // Fused: the gate and the up are each half of the gate_up slice.
                let half = |p: &[u8]| p.len() as u64 * 2 == gu.stride;
                if !(half(j.proj[0]) && half(j.proj[1])) {
                    return Err(ArchError::Tensor {
                        file: String::new(),
                        tensor: gu.info.name.clone(),
                        what: format!(
                            "expert gate and up slices of {} and {} bytes, expected {} each",
                            j.proj[0].len(),
                            j.proj[1].len(),
                            gu.stride / 2
                        ),
                    });
                }
                check_slices(std::slice::from_ref(d), &j.proj[2..])?;
            } else {
                check_slices(xs, &j.proj)?;
            }
            check_uses(layer, m, k, j.uses)?;
        }
        self.prepare_h_acts(st, layer)?;
        let mut rest = jobs;
        while !rest.is_empty() {
            let mut n = rest[0].uses.len();
            let mut end = 1;
            while end < rest.len() && n + rest[end].uses.len() <= group_uses {
                n += rest[end].uses.len();
                end += 1;
            }
            self.experts_group(st, layer, glu, &rest[..end])?;
            rest = &rest[end..];
        }
        Ok(())
    }

    /// One group of [`Model::experts_in_groups`], checked, its inputs prepared.
    fn experts_group(
        &self,
        st: &mut State,
        layer: usize,
        glu: blocks::Glu,
        jobs: &[ExpertJob<'_>],
    ) -> Result<(), ArchError> {
        let Some(([gt, ut, dt], ff)) = self.glu_shape(layer) else {
            return Err(ArchError::Tensor {
                file: String::new(),
                tensor: format!("blk.{layer} experts"),
                what: "not a split gated FFN: cannot run together".into(),
            });
        };
        let (d, k, m) = (self.dims.d_model, st.experts.k, st.ffn_rows.len());
        let n: usize = jobs.iter().map(|j| j.uses.len()).sum();
        if n == 0 {
            return Ok(());
        }
        let State {
            experts:
                ExpertBufs {
                    h_acts,
                    expert_out,
                    per_rank: moe,
                    filled: moe_filled,
                    ..
                },
            scratch,
            ..
        } = st;
        // Every use's prepared input row, expert after expert.
        let picked: Vec<&ActBuf> = jobs
            .iter()
            .flat_map(|j| j.uses.iter().map(|&(row, _, _)| &h_acts[row as usize]))
            .collect();
        scratch.gate.resize(n * ff, 0.0);
        scratch.up.resize(n * ff, 0.0);
        expert_out.resize(n * d, 0.0);
        if scratch.act2.len() < n {
            scratch.act2.resize_with(n, ActBuf::new);
        }
        let (gate, up, act2) = (
            &mut scratch.gate[..n * ff],
            &mut scratch.up[..n * ff],
            &mut scratch.act2[..n],
        );
        // Gate and up of one expert side by side: they share its packed tokens.
        let mut products = Vec::with_capacity(2 * jobs.len());
        for ((j, acts), (gate, up)) in jobs
            .iter()
            .zip(split_by_uses(&picked[..], jobs, 1))
            .zip(split_mut_by_uses(gate, jobs, ff).zip(split_mut_by_uses(up, jobs, ff)))
        {
            for (ty, w, out) in [(gt, j.proj[0], gate), (ut, j.proj[1], up)] {
                products.push(kernels::Product {
                    ty,
                    w,
                    n_rows: ff,
                    n_cols: d,
                    acts,
                    out,
                });
            }
        }
        kernels::matmul_round(&self.cx.pool, &mut products).map_err(blocks::kerr)?;
        drop(products);
        self.activate_rows(layer, glu, jobs, dt, ff, gate, up, act2)?;
        let mut products: Vec<kernels::Product<'_, ActBuf>> = jobs
            .iter()
            .zip(split_by_uses(&act2[..], jobs, 1))
            .zip(split_mut_by_uses(expert_out, jobs, d))
            .map(|((j, acts), out)| kernels::Product {
                ty: dt,
                w: j.proj[2],
                n_rows: d,
                n_cols: ff,
                acts,
                out,
            })
            .collect();
        kernels::matmul_round(&self.cx.pool, &mut products).map_err(blocks::kerr)?;
        drop(products);
        for (j, out) in jobs
            .iter()
            .zip(split_mut_by_uses(&mut expert_out[..], jobs, d))
        {
            if let Some(b) = self.arch.expert_bias(layer, j.expert) {
                blocks::add_bias(out, b.down);
            }
            if let Some(f) = self.arch.expert_scale(layer, j.expert) {
                out.iter_mut().for_each(|v| *v *= f);
            }
        }
        // Each (row, rank) slot's output row and weight; the slots filled across the pool.
        let mut source: Vec<Option<(usize, f32)>> = vec![None; m * k];
        for (i, &(row, rank, w)) in jobs.iter().flat_map(|j| j.uses).enumerate() {
            let slot = row as usize * k + rank as usize;
            source[slot] = Some((i, w));
            moe_filled[slot] = true;
        }
        let out = &expert_out[..];
        rows_in_parallel(&self.cx.pool, &mut moe[..m * k * d], d, &|slot, dst| {
            if let Some((i, w)) = source[slot] {
                for (o, &v) in dst.iter_mut().zip(&out[i * d..(i + 1) * d]) {
                    *o = v * w;
                }
            }
        });
        Ok(())
    }

    /// Every use's gate and up rows (`ff` values each, expert after expert as `jobs` lists
    /// them) plus their expert's biases, if any, through the activation, and the result
    /// quantised for the down projection (`ty`) into `act2`: the rows split across the pool in
    /// one round (a few rows, as decode has, on the caller alone). Per row exactly the steps
    /// [`Arch::expert`] takes over all its rows, so the same bits.
    #[allow(clippy::too_many_arguments)]
    fn activate_rows(
        &self,
        layer: usize,
        glu: blocks::Glu,
        jobs: &[ExpertJob<'_>],
        ty: crate::gguf::GgmlType,
        ff: usize,
        gate: &mut [f32],
        up: &mut [f32],
        act2: &mut [ActBuf],
    ) -> Result<(), ArchError> {
        let n = act2.len();
        let bias: Vec<Option<layers::FfnBias<'_>>> = jobs
            .iter()
            .flat_map(|j| std::iter::repeat_n(self.arch.expert_bias(layer, j.expert), j.uses.len()))
            .collect();
        // As `kernels::prepare_rows` splits a batch: a few rows are not worth the hand-off.
        let per = if n < 4 || n * ff < 8 * 1024 {
            n.max(1)
        } else {
            n.div_ceil(self.cx.pool.n_threads() * 2)
        };
        type Piece<'p, 'b> = (
            &'p mut [f32],
            &'p mut [f32],
            &'p mut [ActBuf],
            &'p [Option<layers::FfnBias<'b>>],
        );
        let pieces: Vec<std::sync::Mutex<Piece<'_, '_>>> = gate
            .chunks_mut(per * ff)
            .zip(up.chunks_mut(per * ff))
            .zip(act2.chunks_mut(per))
            .zip(bias.chunks(per))
            .map(|(((g, u), a), b)| std::sync::Mutex::new((g, u, a, b)))
            .collect();
        let failed = std::sync::Mutex::new(None);
        self.cx.pool.run(pieces.len(), &|task| {
            // Each task locks its own piece only: never contended.
            let mut piece = pieces[task].lock().unwrap_or_else(|e| e.into_inner());
            let (gate, up, acts, bias) = &mut *piece;
            let rows = gate.chunks_exact_mut(ff).zip(up.chunks_exact_mut(ff));
            for ((g, u), (a, b)) in rows.zip(acts.iter_mut().zip(bias.iter())) {
                if let Some(b) = b {
                    blocks::add_bias(g, b.gate);
                    blocks::add_bias(u, b.up);
                }
                glu.apply(g, u);
                if let Err(e) = a.prepare(ty, g) {
                    *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                    return;
                }
            }
        });
        match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(blocks::kerr(e)),
            None => Ok(()),
        }
    }

    /// Sum each FFN row's weighted expert outputs in rank order (ranks never computed — dropped
    /// by a policy — contribute nothing) into `st.moe_out`, then the architecture's finish.
    pub fn finish_layer(&self, st: &mut State, layer: usize) -> Result<(), ArchError> {
        let (d, k) = (self.dims.d_model, st.experts.k);
        let m = st.ffn_rows.len();
        if !self.experts(layer).is_empty() {
            st.moe_out.clear();
            st.moe_out.resize(m * d, 0.0);
            let (moe, filled) = (&st.experts.per_rank, &st.experts.filled);
            rows_in_parallel(&self.cx.pool, &mut st.moe_out, d, &|i, acc| {
                let mut first = true;
                for j in 0..k {
                    let slot = i * k + j;
                    if !filled[slot] {
                        continue;
                    }
                    let src = &moe[slot * d..(slot + 1) * d];
                    if first {
                        acc.copy_from_slice(src);
                        first = false;
                    } else {
                        for (x, &y) in acc.iter_mut().zip(src) {
                            *x += y;
                        }
                    }
                }
            });
        }
        self.arch.finish_layer(&self.cx, st, layer)?;
        self.check_l_out(st, layer)
    }

    /// Final norm and output head for the output rows; logits land in `st.logits`
    /// (`out_rows.len() × n_vocab`).
    pub fn head(&self, st: &mut State) -> Result<(), ArchError> {
        self.arch.head(&self.cx, st)
    }
}

/// Most rows (uses) [`Model::experts_together`] runs in one group: its scratch is about
/// `(d_model + 2 · ff) · 4` bytes per row (~60 MB on the 30B-A3B shape), and a group this large
/// (a 512-token batch at top-8) already keeps both threads busy.
pub const GROUP_USES: usize = 4096;

/// An error unless each of an expert's projection slices `proj` has its tensor's stride.
fn check_slices(xs: &[ExpertTensor], proj: &[&[u8]]) -> Result<(), ArchError> {
    for (p, x) in proj.iter().zip(xs) {
        if p.len() as u64 != x.stride {
            return Err(ArchError::Tensor {
                file: String::new(),
                tensor: x.info.name.clone(),
                what: format!("expert slice of {} bytes, expected {}", p.len(), x.stride),
            });
        }
    }
    Ok(())
}

/// An error unless every (row, rank, weight) use names one of the layer's `m` FFN rows and
/// one of its `k` ranks.
fn check_uses(layer: usize, m: usize, k: usize, uses: &[(u32, u16, f32)]) -> Result<(), ArchError> {
    for &(row, rank, _) in uses {
        let what = if row as usize >= m {
            format!("expert use of FFN row {row}, but the layer has {m}")
        } else if rank as usize >= k {
            format!("expert rank {rank}, but the layer keeps {k}")
        } else {
            continue;
        };
        return Err(ArchError::Tensor {
            file: String::new(),
            tensor: format!("blk.{layer} experts"),
            what,
        });
    }
    Ok(())
}

/// An expert's output rows (`uses.len() × d`, in the order of `uses`), each times its weight
/// into its (row, rank) slot of `moe` (`k` slots per row), marked filled.
fn place_weighted(
    moe: &mut [f32],
    moe_filled: &mut [bool],
    d: usize,
    k: usize,
    uses: &[(u32, u16, f32)],
    out: &[f32],
) {
    for (&(row, rank, w), y) in uses.iter().zip(out.chunks_exact(d)) {
        let slot = row as usize * k + rank as usize;
        for (o, &v) in moe[slot * d..(slot + 1) * d].iter_mut().zip(y) {
            *o = v * w;
        }
        moe_filled[slot] = true;
    }
}

/// `f(i, row)` for every row `i` of `data` (rows of `len` values), the rows split across the
/// pool in one round (a small `data`, on the caller alone). Each row is written by one call,
/// so the bits do not depend on the threads.
fn rows_in_parallel(
    pool: &kernels::ThreadPool,
    data: &mut [f32],
    len: usize,
    f: &(dyn Fn(usize, &mut [f32]) + Sync),
) {
    let len = len.max(1);
    let n = data.len() / len;
    // A few rows (decode's 8 slots) are not worth the hand-off: a value costs well under a
    // nanosecond here, a round several microseconds.
    let per = if n < 4 || data.len() < 32 * 1024 {
        n.max(1)
    } else {
        n.div_ceil(pool.n_threads() * 2)
    };
    let pieces: Vec<std::sync::Mutex<&mut [f32]>> = data
        .chunks_mut(per * len)
        .map(std::sync::Mutex::new)
        .collect();
    pool.run(pieces.len(), &|task| {
        // Each task locks its own piece only: never contended.
        let mut piece = pieces[task].lock().unwrap_or_else(|e| e.into_inner());
        for (r, row) in piece.chunks_exact_mut(len).enumerate() {
            f(task * per + r, row);
        }
    });
}

/// `v` cut into consecutive pieces of `per` elements for each use of each job, job by job.
fn split_by_uses<'a, T>(
    mut v: &'a [T],
    jobs: &'a [ExpertJob<'a>],
    per: usize,
) -> impl Iterator<Item = &'a [T]> + 'a {
    jobs.iter().map(move |j| {
        let (piece, rest) = v.split_at(j.uses.len() * per);
        v = rest;
        piece
    })
}

/// [`split_by_uses`] of a mutable slice.
fn split_mut_by_uses<'a, T>(
    mut v: &'a mut [T],
    jobs: &'a [ExpertJob<'a>],
    per: usize,
) -> impl Iterator<Item = &'a mut [T]> + 'a {
    jobs.iter().map(move |j| {
        let (piece, rest) = std::mem::take(&mut v).split_at_mut(j.uses.len() * per);
        v = rest;
        piece
    })
}

/// Load `file` as the architecture it names and bind it to `threads` compute threads.
pub fn load_model(
    file: Arc<GgufFile>,
    mode: DenseMode,
    threads: usize,
) -> Result<Model, ArchError> {
    Ok(Model::new(load(file, mode)?, threads))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gen::{self, GenOptions, Preset, TypeScheme};

    /// The tiny model of `arch` and `scheme` on 2 threads (seed 3).
    fn tiny_model(arch: gen::GenArch, scheme: &str, types: TypeScheme) -> Model {
        let opts = GenOptions {
            seed: 3,
            shape: Preset::Tiny.shape_for(arch).unwrap(),
            vocab: crate::vocab::builtin_vocab().unwrap(),
            ..gen::tests::options(Preset::Tiny, types)
        };
        // One file per call: `cargo test` runs this module's tests as threads of one process
        // (the aarch64 run under qemu does), and two of them build the same arch and scheme.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "bmoe-experts-together-{}-{call}-{}-{scheme}.gguf",
            std::process::id(),
            arch.name()
        ));
        gen::generate(&opts, &path, |_, _| {}).unwrap();
        let file = Arc::new(GgufFile::open(&path).unwrap());
        let model = load_model(file, DenseMode::Mmap, 2).unwrap();
        let _ = std::fs::remove_file(&path);
        model
    }

    /// An expert's (FFN row, rank, weight) uses.
    type Uses = Vec<(u32, u16, f32)>;

    /// Per expert of the routing `ro`, its uses, experts in id order.
    fn uses_of(ro: &RouteOut) -> Vec<(usize, Uses)> {
        let mut by_expert: std::collections::BTreeMap<usize, Uses> = Default::default();
        for i in 0..ro.rows.len() {
            for rank in 0..ro.k {
                let e = ro.ids[i * ro.k + rank] as usize;
                by_expert.entry(e).or_default().push((
                    i as u32,
                    rank as u16,
                    ro.weights[i * ro.k + rank],
                ));
            }
        }
        by_expert.into_iter().collect()
    }

    /// A layer's experts computed together ([`Model::experts_together`]) land in every (row,
    /// rank) slot with exactly the bits of computing them one by one ([`Model::expert`]), at
    /// every layer, for K-quant experts (Q4_K gate/up, Q6_K down) and Q8_0 ones, qwen3moe,
    /// qwen2moe (its shared expert beside them), gpt-oss (biased experts), gemma4 (a fused
    /// gate_up split in halves, GELU, a scale per expert) and lfm2moe (sigmoid routing with a
    /// selection bias, a dense first layer, short-conv layers), on 2 threads:
    /// decode steps (one row) and a prefill batch of 40 rows (about 10 per expert: some get
    /// one, some more than 8, so the one-token, grouped and lanes kernels all run; layer 1 in
    /// groups of at most 7 rows). The logits of the two
    /// runs, each fed its own layers' sums, agree bit for bit too. `mix` spoils the together
    /// run's jobs (a weight, a row, a rank) to show the comparison catches it.
    fn together_against_one_by_one(mix: Option<usize>) {
        for (arch, scheme) in [
            (gen::GenArch::Qwen3Moe, "q4_k_m"),
            (gen::GenArch::Qwen3Moe, "q8_0"),
            (gen::GenArch::Qwen2Moe, "q4_k_m"),
            (gen::GenArch::GptOss, "mxfp4_moe"),
            (gen::GenArch::Gemma4, "q4_k_m"),
            (gen::GenArch::Lfm2Moe, "q4_k_m"),
            (gen::GenArch::Qwen35Moe, "q4_k_m"),
            (gen::GenArch::Deepseek2, "q4_k_m"),
        ] {
            let types = TypeScheme::from_name(scheme).unwrap();
            let model = tiny_model(arch, scheme, types);
            let scheme = format!("{} {scheme}", arch.name());
            let (mut one, mut together) = (model.new_state(64), model.new_state(64));
            let mut ro = RouteOut::default();
            let w = model.arch.weights();
            let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 250).collect();
            let positions: Vec<u32> = (0..40).collect();
            let steps: [(&[u32], &[u32]); 3] =
                [(&prompt, &positions), (&[42], &[40]), (&[7], &[41])];
            for (tokens, pos) in steps {
                let out_rows: Vec<u32> = (0..tokens.len() as u32).collect();
                for st in [&mut one, &mut together] {
                    model.begin(st, tokens, pos, &out_rows).unwrap();
                }
                for layer in 0..model.dims().n_layer {
                    for st in [&mut one, &mut together] {
                        model.dense(st, layer).unwrap();
                    }
                    if model.experts(layer).is_empty() {
                        continue;
                    }
                    assert!(model.experts_batchable(layer), "{scheme} layer {layer}");
                    model.route(&mut one, layer, &mut ro).unwrap();
                    let xs = model.experts(layer);
                    // In read order for one by one (gemma4's fused gate_up and down: two),
                    // split into gate, up and down for the jobs.
                    let read = |e: usize| -> Vec<&[u8]> {
                        xs.iter().map(|x| w.expert_bytes(x, e)).collect()
                    };
                    let proj = |e: usize| model.resident_job_proj(layer, e).unwrap();
                    let mut uses = uses_of(&ro);
                    // One by one, in reverse id order (as an overlapped run might).
                    for (e, u) in uses.iter().rev() {
                        model.expert(&mut one, layer, *e, &read(*e), u).unwrap();
                    }
                    if let (Some(which), Some((_, u))) =
                        (mix, uses.iter_mut().find(|(_, u)| u.len() > 1))
                    {
                        match which {
                            0 => u[0].2 *= 1.0 + f32::EPSILON,
                            1 => u[0].0 = (u[0].0 + 1) % ro.rows.len() as u32,
                            _ => u[0].1 = (u[0].1 + 1) % ro.k as u16,
                        }
                    }
                    let jobs: Vec<ExpertJob<'_>> = uses
                        .iter()
                        .map(|(e, u)| ExpertJob {
                            expert: *e,
                            proj: proj(*e),
                            uses: u,
                        })
                        .collect();
                    together
                        .experts
                        .per_rank
                        .iter_mut()
                        .for_each(|v| *v = f32::NAN);
                    // Groups of at most 7 rows on one layer (experts of more rows alone).
                    let group = if layer == 1 { 7 } else { GROUP_USES };
                    model
                        .experts_in_groups(&mut together, layer, &jobs, group)
                        .unwrap();
                    let bits = |st: &State| -> Vec<u32> {
                        st.experts.per_rank.iter().map(|v| v.to_bits()).collect()
                    };
                    assert!(
                        one.experts.filled.iter().all(|&f| f),
                        "{scheme} layer {layer}"
                    );
                    assert_eq!(
                        one.experts.filled, together.experts.filled,
                        "{scheme} layer {layer}"
                    );
                    assert_eq!(
                        bits(&one),
                        bits(&together),
                        "{scheme} rows {} layer {layer}",
                        tokens.len()
                    );
                    for st in [&mut one, &mut together] {
                        model.finish_layer(st, layer).unwrap();
                    }
                }
                for st in [&mut one, &mut together] {
                    model.head(st).unwrap();
                }
                let logits =
                    |st: &State| -> Vec<u32> { st.logits.iter().map(|v| v.to_bits()).collect() };
                assert_eq!(
                    logits(&one),
                    logits(&together),
                    "{scheme} rows {}",
                    tokens.len()
                );
            }
        }
    }

    #[test]
    fn experts_together_equal_experts_one_by_one() {
        together_against_one_by_one(None);
    }

    /// The comparison above is not blind: a weight off by one ulp, a use moved to another
    /// row's slot, or to another rank's, each break it.
    #[test]
    fn experts_together_test_catches_a_mixed_up_slot_or_weight() {
        for which in 0..3 {
            let r = std::panic::catch_unwind(|| together_against_one_by_one(Some(which)));
            assert!(r.is_err(), "mix-up {which} went unnoticed");
        }
    }
}
