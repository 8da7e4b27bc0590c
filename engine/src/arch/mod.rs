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

pub mod blocks;
pub mod gemma4;
pub mod gpt_oss;
pub mod meta;
pub mod qwen2moe;
pub mod qwen3moe;
pub mod state;
pub mod weights;

use crate::dense::DenseMode;
use crate::gguf::GgufFile;
use crate::kernels::{self, ActBuf};
use blocks::Compute;
use bmoe_core::Gating;
pub use state::{KvSnapshot, LayerMemory, MemoryKind, Scratch, State};
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
pub trait Arch: Send + Sync {
    /// `general.architecture`.
    fn name(&self) -> &'static str;
    fn dims(&self) -> &Dims;
    /// How the router selects and weights its experts.
    fn gating(&self) -> Gating;
    /// The dense side (the file, the dense bytes per layer, their address ranges).
    fn weights(&self) -> &Weights;
    /// The MoE layers in model order.
    fn moe_layers(&self) -> Vec<MoeLayer<'_>>;
    /// What model layer `layer` remembers between steps.
    fn memory(&self, layer: usize) -> LayerMemory;
    /// The token embedding matrix.
    fn token_embd(&self) -> &Mat;
    /// A factor the embedded rows are multiplied by (gemma: √d_model).
    fn embed_scale(&self) -> Option<f32> {
        None
    }
    /// Everything of layer `layer` that is not routed experts, over `st.x` (every batch row).
    /// For a MoE layer it leaves the experts' input in `st.h` (and the router's in
    /// `st.router_in` with `st.router_separate` when they differ), one row per `st.ffn_rows`;
    /// a dense layer finishes itself.
    fn dense(&self, cx: &Compute, st: &mut State, layer: usize) -> Result<(), ArchError>;
    /// The router's logits of layer `layer` for `rows` rows of router input.
    fn router_logits(
        &self,
        cx: &Compute,
        layer: usize,
        input: &[f32],
        rows: usize,
        acts: &mut Vec<ActBuf>,
        out: &mut [f32],
    ) -> Result<(), ArchError>;
    /// A per-expert bias added for selection only (sigmoid gating); none by default.
    fn selection_bias(&self, _layer: usize) -> Option<&[f32]> {
        None
    }
    /// Expert `expert` of layer `layer` on the input rows of `input`, its projections' bytes
    /// in `proj` (read order); the unweighted output rows into `out`.
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
    ) -> Result<(), ArchError>;
    /// The activation of layer `layer`'s experts when each one is exactly
    /// `down(glu(gate·x, up·x))` over its three projections (gate, up, down; no biases, no
    /// scales), which lets [`Model::experts_one_row`] run a decode step's experts together.
    /// `None` (the default) computes every expert through [`Arch::expert`].
    fn split_glu(&self, _layer: usize) -> Option<blocks::Glu> {
        None
    }
    /// Combine `st.moe_out` (and anything `dense` left in `st.side`) into the residual stream.
    fn finish_layer(&self, cx: &Compute, st: &mut State, layer: usize) -> Result<(), ArchError>;
    /// Final norm and output head for `st.out_rows` into `st.logits`.
    fn head(&self, cx: &Compute, st: &mut State) -> Result<(), ArchError>;
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

/// One routed expert of a step whose layer has a single FFN row (decode), for
/// [`Model::experts_one_row`].
pub struct RowExpert<'a> {
    pub expert: usize,
    /// The expert's projections' bytes in read order (gate, up, down).
    pub proj: [&'a [u8]; 3],
    /// Its rank in the row's routing and its weight.
    pub rank: u16,
    pub weight: f32,
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
        name: gemma4::ARCH,
        about: "Gemma 4 MoE (Gemma-4-26B-A4B): a dense GELU MLP beside GELU-gated fused gate_up experts with per-expert down scales, softmax top-k routing (renormalised) on its own scaled input, sliding-window and global layers, logit soft-capping",
        load: gemma4::load,
    },
    ArchEntry {
        name: gpt_oss::ARCH,
        about: "gpt-oss (gpt-oss-20b, gpt-oss-120b): top-k on the raw router logits (biased), softmax over the k, clamped-SwiGLU experts with per-expert biases, attention sinks, sliding-window layers on a ring KV",
        load: gpt_oss::load,
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
        st.pred_layer = None;
        st.positions.clear();
        st.positions.extend_from_slice(positions);
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
        if layer + 1 == self.dims.n_layer {
            st.ffn_rows.extend_from_slice(&st.out_rows);
        } else {
            st.ffn_rows.extend(0..st.n_rows as u32);
        }
        st.router_separate = false;
        // `dense` rewrites the experts' input: its quantised rows are stale.
        st.h_acts_for = None;
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
        st.moe_k = k;
        st.moe.resize(m * k * d, 0.0);
        st.moe_filled.clear();
        st.moe_filled.resize(m * k, false);
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
        let mut acts = std::mem::take(&mut st.scratch.acts);
        let input = if st.router_separate {
            std::mem::take(&mut st.router_in)
        } else {
            std::mem::take(&mut st.h)
        };
        let r = self
            .arch
            .router_logits(&self.cx, layer, &input, m, &mut acts, &mut out.probs);
        st.scratch.acts = acts;
        // Keep the last row's router input for `predict` (a later layer's router on it).
        st.pred_in.clear();
        if m > 0 {
            st.pred_in.extend_from_slice(&input[(m - 1) * d..m * d]);
            st.pred_layer = Some(layer);
        } else {
            st.pred_layer = None;
        }
        if st.router_separate {
            st.router_in = input;
        } else {
            st.h = input;
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
        let mut order = std::mem::take(&mut st.pred_order);
        for r in 0..m {
            let scores = &mut out.probs[r * ne..(r + 1) * ne];
            self.gating.scores_in_place(scores);
            self.gating.select(
                scores,
                bias,
                &mut order,
                &mut out.ids[r * k..(r + 1) * k],
                &mut out.weights[r * k..(r + 1) * k],
            );
        }
        st.pred_order = order;
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
        if st.pred_layer != Some(from) || self.experts(target).is_empty() || k == 0 || k > ne {
            return Ok(false);
        }
        st.pred_scores.resize(ne, 0.0);
        let mut scores = std::mem::take(&mut st.pred_scores);
        let mut acts = std::mem::take(&mut st.pred_acts);
        let r = self
            .arch
            .router_logits(&self.cx, target, &st.pred_in, 1, &mut acts, &mut scores);
        st.pred_acts = acts;
        if let Err(e) = r {
            st.pred_scores = scores;
            return Err(e);
        }
        ids.resize(k, 0);
        weights.resize(k, 0.0);
        let mut order = std::mem::take(&mut st.pred_order);
        self.gating.scores_in_place(&mut scores);
        self.gating.select(
            &scores,
            self.arch.selection_bias(target),
            &mut order,
            ids,
            weights,
        );
        st.pred_order = order;
        st.pred_scores = scores;
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
        let (d, k) = (self.dims.d_model, st.moe_k);
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
        for (p, x) in proj.iter().zip(xs) {
            if p.len() as u64 != x.stride {
                return Err(ArchError::Tensor {
                    file: String::new(),
                    tensor: x.info.name.clone(),
                    what: format!("expert slice of {} bytes, expected {}", p.len(), x.stride),
                });
            }
        }
        let m = st.ffn_rows.len();
        self.prepare_h_acts(st, layer)?;
        let State {
            h,
            h_acts,
            h_acts_for,
            expert_in,
            expert_out,
            scratch,
            moe,
            moe_filled,
            ..
        } = st;
        expert_in.resize(n * d, 0.0);
        let mut picked: Vec<&ActBuf> = Vec::with_capacity(n);
        for (i, &(row, _, _)) in uses.iter().enumerate() {
            let r = row as usize;
            if r >= m {
                return Err(ArchError::Tensor {
                    file: String::new(),
                    tensor: format!("blk.{layer} experts"),
                    what: format!("expert use of FFN row {row}, but the layer has {m}"),
                });
            }
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
        for (i, &(row, rank, w)) in uses.iter().enumerate() {
            let slot = row as usize * k + rank as usize;
            let dst = &mut moe[slot * d..(slot + 1) * d];
            for (o, &y) in dst.iter_mut().zip(&expert_out[i * d..(i + 1) * d]) {
                *o = y * w;
            }
            moe_filled[slot] = true;
        }
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
        if fmt.is_some() && st.h_acts_for != fmt.map(|f| (layer, f)) {
            st.h_acts_for = None;
            let (m, d) = (st.ffn_rows.len(), self.dims.d_model);
            blocks::prepare_acts(&self.cx.pool, ty, &st.h, m, d, &mut st.h_acts)?;
            st.h_acts_for = fmt.map(|f| (layer, f));
        }
        Ok(())
    }

    /// True when [`Model::experts_one_row`] runs layer `layer`'s experts together: they are
    /// split gated FFNs ([`Arch::split_glu`]) whose gate and up read one activation format, and
    /// the step has one FFN row.
    pub fn experts_batchable(&self, st: &State, layer: usize) -> bool {
        let xs = self.experts(layer);
        st.ffn_rows.len() == 1
            && xs.len() == 3
            && self.arch.split_glu(layer).is_some()
            && kernels::ActFormat::for_weights(xs[0].info.ty).is_some()
            && kernels::ActFormat::for_weights(xs[0].info.ty)
                == kernels::ActFormat::for_weights(xs[1].info.ty)
    }

    /// The routed experts of a layer with a single FFN row (a decode step), all at once:
    /// every expert's gate and up in one round of the pool, the activations between them, then
    /// every down in one more — two hand-offs per layer instead of two per expert. Each
    /// output row gets exactly the bits [`Model::expert`] gives it (the same kernels on the
    /// same rows and activations), lands weighted in its rank's slot, and is summed in rank
    /// order by `finish_layer` as before. Where the layer is not [`Model::experts_batchable`]
    /// it computes the experts one by one through [`Model::expert`].
    pub fn experts_one_row(
        &self,
        st: &mut State,
        layer: usize,
        jobs: &[RowExpert<'_>],
    ) -> Result<(), ArchError> {
        let glu = match self.arch.split_glu(layer) {
            Some(glu) if self.experts_batchable(st, layer) => glu,
            _ => {
                for j in jobs {
                    self.expert(st, layer, j.expert, &j.proj, &[(0, j.rank, j.weight)])?;
                }
                return Ok(());
            }
        };
        if jobs.is_empty() {
            return Ok(());
        }
        let xs = self.experts(layer);
        let (g, u, dn) = (&xs[0], &xs[1], &xs[2]);
        for j in jobs {
            for (p, x) in j.proj.iter().zip(xs) {
                if p.len() as u64 != x.stride {
                    return Err(ArchError::Tensor {
                        file: String::new(),
                        tensor: x.info.name.clone(),
                        what: format!("expert slice of {} bytes, expected {}", p.len(), x.stride),
                    });
                }
            }
            if j.rank as usize >= st.moe_k {
                return Err(ArchError::Tensor {
                    file: String::new(),
                    tensor: format!("blk.{layer} experts"),
                    what: format!("expert rank {}, but the layer keeps {}", j.rank, st.moe_k),
                });
            }
        }
        self.prepare_h_acts(st, layer)?;
        let (d, ff, n) = (self.dims.d_model, g.rows, jobs.len());
        let State {
            h_acts,
            expert_out,
            scratch,
            moe,
            moe_filled,
            ..
        } = st;
        scratch.gate.resize(n * ff, 0.0);
        scratch.up.resize(n * ff, 0.0);
        expert_out.resize(n * d, 0.0);
        let act = std::slice::from_ref(&h_acts[0]);
        let mut products = Vec::with_capacity(2 * n);
        for ((j, gate), up) in jobs
            .iter()
            .zip(scratch.gate.chunks_exact_mut(ff))
            .zip(scratch.up.chunks_exact_mut(ff))
        {
            for (ty, w, out) in [(g.info.ty, j.proj[0], gate), (u.info.ty, j.proj[1], up)] {
                products.push(kernels::Product {
                    ty,
                    w,
                    n_rows: ff,
                    n_cols: d,
                    acts: act,
                    out,
                });
            }
        }
        kernels::matmul_round(&self.cx.pool, &mut products).map_err(blocks::kerr)?;
        drop(products);
        if scratch.act2.len() < n {
            scratch.act2.resize_with(n, ActBuf::new);
        }
        for ((gate, up), a) in scratch
            .gate
            .chunks_exact_mut(ff)
            .zip(scratch.up.chunks_exact(ff))
            .zip(scratch.act2.iter_mut())
        {
            glu.apply(gate, up);
            a.prepare(dn.info.ty, gate).map_err(blocks::kerr)?;
        }
        let mut products: Vec<kernels::Product<'_, ActBuf>> = jobs
            .iter()
            .zip(expert_out.chunks_exact_mut(d))
            .zip(&scratch.act2)
            .map(|((j, out), a)| kernels::Product {
                ty: dn.info.ty,
                w: j.proj[2],
                n_rows: d,
                n_cols: ff,
                acts: std::slice::from_ref(a),
                out,
            })
            .collect();
        kernels::matmul_round(&self.cx.pool, &mut products).map_err(blocks::kerr)?;
        drop(products);
        // The one FFN row is row 0: its rank r's slot is r.
        for (j, y) in jobs.iter().zip(expert_out.chunks_exact(d)) {
            let slot = j.rank as usize;
            for (o, &v) in moe[slot * d..(slot + 1) * d].iter_mut().zip(y) {
                *o = v * j.weight;
            }
            moe_filled[slot] = true;
        }
        Ok(())
    }

    /// Sum each FFN row's weighted expert outputs in rank order (ranks never computed — dropped
    /// by a policy — contribute nothing) into `st.moe_out`, then the architecture's finish.
    pub fn finish_layer(&self, st: &mut State, layer: usize) -> Result<(), ArchError> {
        let (d, k) = (self.dims.d_model, st.moe_k);
        let m = st.ffn_rows.len();
        if !self.experts(layer).is_empty() {
            st.moe_out.clear();
            st.moe_out.resize(m * d, 0.0);
            for i in 0..m {
                let mut first = true;
                let acc = &mut st.moe_out[i * d..(i + 1) * d];
                for j in 0..k {
                    let slot = i * k + j;
                    if !st.moe_filled[slot] {
                        continue;
                    }
                    let src = &st.moe[slot * d..(slot + 1) * d];
                    if first {
                        acc.copy_from_slice(src);
                        first = false;
                    } else {
                        for (x, &y) in acc.iter_mut().zip(src) {
                            *x += y;
                        }
                    }
                }
            }
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

    /// A decode step's experts computed together ([`Model::experts_one_row`]) land in every
    /// rank's slot with exactly the bits of computing them one by one ([`Model::expert`]), at
    /// every layer, for K-quant experts (Q4_K gate/up, Q6_K down) and Q8_0 ones, on 2 threads.
    #[test]
    fn experts_together_equal_experts_one_by_one() {
        for (scheme, types) in [
            ("q4_k_m", TypeScheme::q4_k_m()),
            ("q8_0", TypeScheme::from_name("q8_0").unwrap()),
        ] {
            let opts = GenOptions {
                seed: 3,
                ..gen::tests::options(Preset::Tiny, types)
            };
            let path = std::env::temp_dir().join(format!(
                "bmoe-experts-together-{}-{scheme}.gguf",
                std::process::id()
            ));
            gen::generate(&opts, &path, |_, _| {}).unwrap();
            let file = Arc::new(GgufFile::open(&path).unwrap());
            let model = load_model(file, DenseMode::Mmap, 2).unwrap();
            let _ = std::fs::remove_file(&path);
            let mut st = model.new_state(16);
            let mut ro = RouteOut::default();
            let w = model.arch.weights();
            for (pos, token) in [(0u32, 7u32), (1, 42), (2, 255)] {
                model.begin(&mut st, &[token], &[pos], &[0]).unwrap();
                for layer in 0..model.dims().n_layer {
                    model.dense(&mut st, layer).unwrap();
                    if model.experts(layer).is_empty() {
                        continue;
                    }
                    assert!(
                        model.experts_batchable(&st, layer),
                        "{scheme} layer {layer}"
                    );
                    model.route(&mut st, layer, &mut ro).unwrap();
                    let xs = model.experts(layer);
                    let jobs: Vec<RowExpert<'_>> = (0..ro.k)
                        .map(|rank| {
                            let e = ro.ids[rank] as usize;
                            RowExpert {
                                expert: e,
                                proj: [0, 1, 2].map(|p| w.expert_bytes(&xs[p], e)),
                                rank: rank as u16,
                                weight: ro.weights[rank],
                            }
                        })
                        .collect();
                    // One by one, in reverse rank order (as an overlapped run might).
                    for j in jobs.iter().rev() {
                        model
                            .expert(&mut st, layer, j.expert, &j.proj, &[(0, j.rank, j.weight)])
                            .unwrap();
                    }
                    let one_by_one: Vec<u32> = st.moe.iter().map(|v| v.to_bits()).collect();
                    assert!(st.moe_filled.iter().all(|&f| f));
                    st.moe.iter_mut().for_each(|v| *v = f32::NAN);
                    st.moe_filled.iter_mut().for_each(|f| *f = false);
                    model.experts_one_row(&mut st, layer, &jobs).unwrap();
                    let together: Vec<u32> = st.moe.iter().map(|v| v.to_bits()).collect();
                    assert!(st.moe_filled.iter().all(|&f| f));
                    assert_eq!(
                        one_by_one, together,
                        "{scheme} position {pos} layer {layer}"
                    );
                    model.finish_layer(&mut st, layer).unwrap();
                }
                model.head(&mut st).unwrap();
            }
        }
    }
}
