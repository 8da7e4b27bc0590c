//! The compute side of a decode step, as the core sees it: the `Backend` trait, the
//! `Routing` the router writes into, and the slot names the core uses for expert memory.
//!
//! The engine implements `Backend` with real kernels over GGUF tensors; the simulator replays
//! a route trace and charges modelled time to its clock. The decode step (`step.rs`) is the
//! only caller, in a fixed order, so *what happens when* is written once.

pub use crate::vocab::{BackendStage, LayerId, RoutingError, SlotId};

/// One routing of a batch row to an expert, as handed to `Backend::expert`.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct ExpertUse {
    /// Row of this layer's `Routing` (not necessarily the batch row: see `Routing::batch_row`).
    pub row: u32,
    /// Rank in the router's order (0 = top choice): the slot `finish_layer` sums it into.
    pub rank: u16,
    /// Final applied weight.
    pub weight: f32,
}

/// One layer's routing for a batch, in the router's rank order.
///
/// Flat, reusable arrays: the step owns one `Routing`, clears it before every `route` call
/// and the backend appends rows, so no step allocates once capacities have grown. Row `r`
/// holds `k` (expert id, final weight) pairs, rank 0 first, plus an optional full score
/// vector (`n_expert` wide, in the model's gating's space: softmax probabilities, gpt-oss's
/// raw logits, sigmoid scores — see `Gating`) for hooks that re-rank or re-weigh, and a
/// per-entry `dropped` flag set by cache-aware dropping (a dropped entry is neither read nor
/// computed, but is still traced). A sigmoid-gated layer may also carry its selection bias.
///
/// Rows need not cover the whole batch: before the final layer a forward pass may gather only
/// the tokens whose logits are wanted (llama.cpp routes only the last prompt token at the last
/// layer of a prefill). Each row therefore names its `batch_row`, and the backend decides.
#[derive(Clone, Debug, Default)]
pub struct Routing {
    n_expert: u32,
    n_tokens: u32,
    k: usize,
    batch_rows: Vec<u32>,
    ids: Vec<u16>,
    weights: Vec<f32>,
    dropped: Vec<bool>,
    probs: Vec<f32>,
    has_probs: Option<bool>,
    bias: Vec<f32>,
}

impl Routing {
    /// An empty routing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forget all rows and prepare for a layer with `n_expert` experts and a batch of
    /// `n_tokens` tokens. Keeps capacity. Called by the step before `Backend::route`.
    pub fn reset(&mut self, n_expert: u32, n_tokens: u32) {
        self.n_expert = n_expert;
        self.n_tokens = n_tokens;
        self.k = 0;
        self.batch_rows.clear();
        self.ids.clear();
        self.weights.clear();
        self.dropped.clear();
        self.probs.clear();
        self.has_probs = None;
        self.bias.clear();
    }

    /// The layer's per-expert selection bias (`n_expert` wide; sigmoid gating adds it to the
    /// scores for selection only). A bias of the wrong width is ignored.
    pub fn set_selection_bias(&mut self, bias: &[f32]) {
        self.bias.clear();
        if bias.len() == self.n_expert as usize {
            self.bias.extend_from_slice(bias);
        }
    }

    /// The selection bias the backend set for this layer, if any.
    pub fn selection_bias(&self) -> Option<&[f32]> {
        (!self.bias.is_empty()).then_some(&self.bias[..])
    }

    /// Append the routing of batch row `batch_row`: expert ids and final weights in rank
    /// order. Every row of a layer has the same width. Ids are range-checked by the step
    /// after the router hooks ran (`validate`).
    pub fn push_row(
        &mut self,
        batch_row: u32,
        ids: &[u16],
        weights: &[f32],
    ) -> Result<(), RoutingError> {
        self.push_common(batch_row, ids, weights, false)?;
        Ok(())
    }

    /// `push_row` plus the router's full probability vector (`n_expert` wide) for this row.
    pub fn push_row_with_probs(
        &mut self,
        batch_row: u32,
        ids: &[u16],
        weights: &[f32],
        probs: &[f32],
    ) -> Result<(), RoutingError> {
        if probs.len() != self.n_expert as usize {
            return Err(RoutingError::ProbsLength {
                n_expert: self.n_expert,
                got: probs.len(),
            });
        }
        self.push_common(batch_row, ids, weights, true)?;
        self.probs.extend_from_slice(probs);
        Ok(())
    }

    fn push_common(
        &mut self,
        batch_row: u32,
        ids: &[u16],
        weights: &[f32],
        with_probs: bool,
    ) -> Result<(), RoutingError> {
        if ids.len() != weights.len() {
            return Err(RoutingError::LengthMismatch {
                ids: ids.len(),
                weights: weights.len(),
            });
        }
        if ids.is_empty() || ids.len() > u16::MAX as usize {
            return Err(RoutingError::BadWidth { width: ids.len() });
        }
        if !self.batch_rows.is_empty() && ids.len() != self.k {
            return Err(RoutingError::WidthMismatch {
                expected: self.k,
                got: ids.len(),
            });
        }
        if self.has_probs.is_some_and(|h| h != with_probs) {
            return Err(RoutingError::ProbsMixed);
        }
        if batch_row >= self.n_tokens {
            return Err(RoutingError::RowOutOfBatch {
                batch_row,
                n_tokens: self.n_tokens,
            });
        }
        if self.batch_rows.len() >= u32::MAX as usize {
            return Err(RoutingError::TooManyRows {
                rows: self.batch_rows.len() + 1,
            });
        }
        // Every check passed: only now change state, so a refused row leaves no trace.
        self.k = ids.len();
        self.has_probs = Some(with_probs);
        self.batch_rows.push(batch_row);
        self.ids.extend_from_slice(ids);
        self.weights.extend_from_slice(weights);
        self.dropped.extend(std::iter::repeat_n(false, ids.len()));
        Ok(())
    }

    /// Check every id against `n_expert` and for duplicates within a row. The step calls this
    /// after the hooks, so a hook that rewrites ids is held to the same rules as the router.
    pub fn validate(&self, layer: u16) -> Result<(), RoutingError> {
        for r in 0..self.n_rows() {
            let ids = self.ids(r);
            for (rank, &e) in ids.iter().enumerate() {
                if u32::from(e) >= self.n_expert {
                    return Err(RoutingError::ExpertOutOfRange {
                        layer,
                        row: r,
                        rank: rank as u16,
                        expert: e,
                        n_expert: self.n_expert,
                    });
                }
                if ids[..rank].contains(&e) {
                    return Err(RoutingError::DuplicateExpert {
                        layer,
                        row: r,
                        expert: e,
                    });
                }
            }
        }
        Ok(())
    }

    /// Experts in the layer this routing was reset for.
    pub fn n_expert(&self) -> u32 {
        self.n_expert
    }

    /// Rows routed at this layer.
    pub fn n_rows(&self) -> u32 {
        self.batch_rows.len() as u32
    }

    /// Experts per row (0 before the first row).
    pub fn k(&self) -> usize {
        self.k
    }

    /// The batch row (index into the step's tokens/positions) that routing row `row` routes.
    pub fn batch_row(&self, row: u32) -> u32 {
        self.batch_rows[row as usize]
    }

    /// Expert ids of `row`, rank order.
    pub fn ids(&self, row: u32) -> &[u16] {
        let s = row as usize * self.k;
        &self.ids[s..s + self.k]
    }

    /// Mutable expert ids of `row` (for hooks that re-route; checked again by `validate`).
    pub fn ids_mut(&mut self, row: u32) -> &mut [u16] {
        let s = row as usize * self.k;
        &mut self.ids[s..s + self.k]
    }

    /// Final weights of `row`, rank order.
    pub fn weights(&self, row: u32) -> &[f32] {
        let s = row as usize * self.k;
        &self.weights[s..s + self.k]
    }

    /// Mutable final weights of `row`.
    pub fn weights_mut(&mut self, row: u32) -> &mut [f32] {
        let s = row as usize * self.k;
        &mut self.weights[s..s + self.k]
    }

    /// Dropped flags of `row`, rank order.
    pub fn dropped(&self, row: u32) -> &[bool] {
        let s = row as usize * self.k;
        &self.dropped[s..s + self.k]
    }

    /// Mark rank `rank` of `row` dropped: it will be traced with its router weight and
    /// residency but neither read nor computed.
    pub fn drop_entry(&mut self, row: u32, rank: usize) {
        self.dropped[row as usize * self.k + rank] = true;
    }

    /// The router's full scores for `row` (the gating's space), when the backend supplied them.
    pub fn probs(&self, row: u32) -> Option<&[f32]> {
        if self.has_probs != Some(true) {
            return None;
        }
        let n = self.n_expert as usize;
        let s = row as usize * n;
        Some(&self.probs[s..s + n])
    }

    /// Keep only the first `k` ranks of every row (no-op when `k` is 0 or not narrower).
    /// Weights are left as they were; renormalising is the caller's decision.
    pub fn truncate_k(&mut self, k: usize) {
        if k == 0 || k >= self.k {
            return;
        }
        let old = self.k;
        for r in 0..self.batch_rows.len() {
            for j in 0..k {
                self.ids[r * k + j] = self.ids[r * old + j];
                self.weights[r * k + j] = self.weights[r * old + j];
                self.dropped[r * k + j] = self.dropped[r * old + j];
            }
        }
        let n = self.batch_rows.len() * k;
        self.ids.truncate(n);
        self.weights.truncate(n);
        self.dropped.truncate(n);
        self.k = k;
    }
}

/// The compute side of one step over a batch of tokens.
///
/// Call order, per step (the decode step is the only caller):
/// `begin`, then for every model layer `dense`; for a MoE layer additionally `route`, any
/// number of `expert` calls (each routed expert exactly once, in an order that may differ
/// between serial and overlap runs), then `finish_layer`; finally `head`. `release` may be
/// called between any two of these (the cache evicted an expert).
///
/// Contract:
/// - `expert` is called only after every byte of the slot has landed (the core waited for
///   its reads). The backend may read the slot's bytes until the layer's `finish_layer`
///   returns or until `release` of that slot, whichever comes first; if it deferred work on
///   the slot it must finish that work before `release` returns.
/// - `finish_layer` sums the per-(row, rank) outputs **in rank order**, so the order of
///   `expert` calls (completion order under overlap) can never change the result's bytes.
/// - Any error stops the step; the engine that owns this backend refuses further steps
///   (STYLE 12: a failed step means the output is untrustworthy).
pub trait Backend {
    /// The backend's error type; boxed into `StepError::Backend`.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Start a step over `tokens` at context positions `positions` (same length, ≥ 1).
    fn begin(&mut self, tokens: &[u32], positions: &[u32]) -> Result<(), Self::Error>;

    /// What the step calls to start: `begin`, with the whole input, so a backend can name the
    /// step (turn, prefill or decode) in its errors. Default: `begin(tokens, positions)`.
    fn begin_step(&mut self, input: &crate::vocab::StepInput<'_>) -> Result<(), Self::Error> {
        self.begin(input.tokens, input.positions)
    }

    /// Everything of model layer `layer` that is not routed experts: norms, attention, shared
    /// experts, and (for a dense layer) its FFN.
    fn dense(&mut self, layer: u32) -> Result<(), Self::Error>;

    /// Route the MoE layer: push one row per routed batch row into `routing` (already reset
    /// for this layer and batch) with the top-k ids and final weights in rank order.
    fn route(&mut self, layer: LayerId, routing: &mut Routing) -> Result<(), Self::Error>;

    /// Compute expert `expert` of `layer`, whose bytes are in `slot`, for the routing rows in
    /// `uses` (sorted by row, then rank), weighting each output by its weight.
    fn expert(
        &mut self,
        layer: LayerId,
        expert: u16,
        slot: SlotId,
        uses: &[ExpertUse],
    ) -> Result<(), Self::Error>;

    /// Combine the layer's expert outputs (in rank order) into the residual stream.
    fn finish_layer(&mut self, layer: LayerId) -> Result<(), Self::Error>;

    /// Final norm and output head for the batch's last row.
    fn head(&mut self) -> Result<(), Self::Error>;

    /// The cache evicted `slot`: free its memory (the engine `madvise(MADV_DONTNEED)`s it).
    /// The slot's bytes are never read again until a new read fills it.
    fn release(&mut self, slot: SlotId) -> Result<(), Self::Error>;

    /// Expert prediction (`--predict-log`, `--predict-prefetch`, `--route-ahead`): apply MoE
    /// layer `target`'s router to the router input of MoE layer `from` (`from.moe <=
    /// target.moe`) for the batch's last row, and write the top-`k` experts with their
    /// weights (softmax over the selected `k`, renormalised as the architecture does) into
    /// `out`, rank order. Called only between `route(from)` and `finish_layer(from)`. With
    /// `from == target` it must reproduce the router's own choice (the control).
    ///
    /// `Ok(false)` when the backend cannot predict this pair (the default: no prediction).
    /// The engine computes it; the simulator replays what a recorded run predicted.
    fn predict(
        &mut self,
        from: LayerId,
        target: LayerId,
        k: usize,
        out: &mut Prediction,
    ) -> Result<bool, Self::Error> {
        let _ = (from, target, k);
        out.clear();
        Ok(false)
    }

    /// Whether the steps that follow compute logits at every batch row (`true`: a speculative
    /// verify decode, whose rows each choose a token) or at the last row only (`false`, the
    /// default state). A backend that cannot is never asked: see
    /// [`Backend::verifies_rows`]. Default: nothing.
    fn logits_at_every_row(&mut self, on: bool) {
        let _ = on;
    }

    /// Whether this backend has the model's own draft head ([`Backend::head_logits`],
    /// `--mtp`). Default: no.
    fn has_draft_head(&self) -> bool {
        false
    }

    /// The model's draft head (`--mtp`) on `token` at `position`: its logits over the
    /// vocabulary. Not `chained`: `token` is the one about to be fed at `position`, paired with
    /// the trunk's hidden state of the position before (the head first catches up on the steps
    /// it has not seen: what a speculative run's drafting time includes); `chained`: a draft,
    /// paired with the head's own hidden state from its last call. What to draft from them is
    /// the core's (`speculate::head_draft`, a layer above this one). Default: `None` (no head).
    fn head_logits(
        &mut self,
        token: u32,
        position: u32,
        chained: bool,
    ) -> Result<Option<&[f32]>, Self::Error> {
        let _ = (token, position, chained);
        Ok(None)
    }

    /// Whether this backend computes every row's logits on request
    /// ([`Backend::logits_at_every_row`]) with each row's bits equal to a one-token decode's at
    /// its position, and whether its memory outlives a rejected draft: the next step may
    /// start after any row of a verify decode (attention rows past it are simply fed again;
    /// a recurrent state comes back from a copy kept after that row). Speculative decoding
    /// runs only where it does. Default: no.
    fn verifies_rows(&self) -> bool {
        false
    }

    /// The logits of the last step's last batch row over the whole vocabulary, after `head`
    /// (what a `decide` scores its choices on). `None` when the backend computes no logits
    /// (the default: the simulator).
    fn last_logits(&self) -> Option<&[f32]> {
        None
    }

    /// The longest prefix of at most `n` of the positions fed so far that a batch can continue
    /// from: `n` (the default) unless the memory no longer holds what such a batch reads — a
    /// sliding-window layer keeps only the last positions it was fed, so a turn that rolls the
    /// context back further must feed it again from 0 (llama.cpp does the same).
    fn reusable_prefix(&self, n: u32) -> u32 {
        n
    }

    /// Keep a copy of the sequence state of positions `0..n` — every layer's KV rows, and any
    /// recurrent state as it stood after position `n - 1` — replacing any copy kept before
    /// (the `decide` prefix state). Called between steps, after a step that fed at least
    /// positions `0..n`. Returns the bytes the copy holds, or `None` when this backend cannot
    /// keep state (the default); then nothing is kept.
    fn keep_prefix(&mut self, n: u32) -> Result<Option<u64>, Self::Error> {
        let _ = n;
        Ok(None)
    }

    /// Whether [`Backend::keep_prefix`]`(n)` can keep a state only right after a step that
    /// ended at position `n - 1` (a recurrent layer's state stands where it was last fed):
    /// then a decide splits its prefill at the prefix and keeps it between the two steps.
    /// False by default (every layer's memory of `0..n` outlives later positions).
    fn keeps_prefix_where_it_stands(&self) -> bool {
        false
    }

    /// Keep a copy of a recurrent state standing at `n` (a turn boundary: called between two
    /// steps of a prefill split there, only when [`Backend::keeps_prefix_where_it_stands`]),
    /// replacing any copy kept before, so that [`Backend::reusable_prefix`] may later answer
    /// `n` after positions past it were fed. Cheap beside `keep_prefix`: no attention rows are
    /// copied (they outlive later positions). Returns whether a copy is kept; the default
    /// keeps none.
    fn mark_boundary(&mut self, n: u32) -> Result<bool, Self::Error> {
        let _ = n;
        Ok(false)
    }

    /// Put the kept state back: afterwards positions `0..n` read exactly as they did when
    /// `keep_prefix(n)` copied them, whatever was fed since. Returns `n`, or `None` when
    /// nothing is kept (the default).
    fn restore_prefix(&mut self) -> Result<Option<u32>, Self::Error> {
        Ok(None)
    }

    /// Forget the kept state and free its memory (a `generate` overwrites the KV it mirrors).
    fn drop_prefix(&mut self) {}
}

/// One run of a batch's rows that belong to one sequence: rows `first..first + rows`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SeqRun {
    pub seq: u32,
    pub first: u32,
    pub rows: u32,
}

/// A backend that holds the memories (KV) of several sequences at once and runs a batch whose
/// rows belong to different ones: what the lanes module decodes together
/// (`serve --parallel`). Every other call is the plain [`Backend`]'s.
pub trait Sequences: Backend {
    /// How many sequences it holds (sequence ids `0..n`).
    fn n_sequences(&self) -> u32;

    /// Which sequence each row of the next step belongs to: runs in row order that cover
    /// every row once. Stays in force until the next call.
    fn assign_rows(&mut self, runs: &[SeqRun]) -> Result<(), Self::Error>;

    /// [`Backend::reusable_prefix`] of sequence `seq`: how much of a context of `n` tokens
    /// that sequence's memory still holds for a batch to start after.
    fn seq_reusable_prefix(&self, seq: u32, n: u32) -> u32;

    /// The rows of the next steps whose logits the head computes, ascending (row `i` of the
    /// logits is the `i`-th of them); empty: the backend's own choice (the last row, or
    /// every row under [`Backend::logits_at_every_row`]). Stays in force until the next call.
    fn logits_at_rows(&mut self, rows: &[u32]);
}

/// A predicted routing of one layer for one batch row: expert ids in rank order and their
/// weights. Reused across calls (no allocation once grown).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Prediction {
    pub ids: Vec<u16>,
    pub weights: Vec<f32>,
}

impl Prediction {
    /// Forget the ids and weights (keeps capacity).
    pub fn clear(&mut self) {
        self.ids.clear();
        self.weights.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_flat_and_truncation_keeps_rank_order() {
        let mut r = Routing::new();
        r.reset(8, 3);
        r.push_row(0, &[5, 1, 7], &[0.5, 0.3, 0.2]).unwrap();
        r.push_row(2, &[2, 3, 4], &[0.6, 0.3, 0.1]).unwrap();
        r.drop_entry(1, 1);
        assert_eq!(r.n_rows(), 2);
        assert_eq!(r.batch_row(1), 2);
        r.truncate_k(2);
        assert_eq!(r.k(), 2);
        assert_eq!(r.ids(0), &[5, 1]);
        assert_eq!(r.ids(1), &[2, 3]);
        assert_eq!(r.weights(1), &[0.6, 0.3]);
        assert_eq!(r.dropped(1), &[false, true]);
        assert!(r.probs(0).is_none());
        assert_eq!(r.validate(0), Ok(()));
    }

    #[test]
    fn malformed_rows_are_refused() {
        let mut r = Routing::new();
        r.reset(4, 1);
        assert!(matches!(
            r.push_row(0, &[1, 2], &[1.0]),
            Err(RoutingError::LengthMismatch { .. })
        ));
        assert!(matches!(
            r.push_row(1, &[1], &[1.0]),
            Err(RoutingError::RowOutOfBatch { .. })
        ));
        r.push_row(0, &[1, 1], &[0.5, 0.5]).unwrap();
        assert!(matches!(
            r.validate(3),
            Err(RoutingError::DuplicateExpert {
                layer: 3,
                expert: 1,
                ..
            })
        ));
        assert!(matches!(
            r.push_row(0, &[1], &[1.0]),
            Err(RoutingError::WidthMismatch { .. })
        ));
        r.reset(4, 1);
        r.push_row(0, &[4], &[1.0]).unwrap();
        assert!(matches!(
            r.validate(0),
            Err(RoutingError::ExpertOutOfRange { expert: 4, .. })
        ));
        r.reset(4, 2);
        r.push_row_with_probs(0, &[1], &[1.0], &[0.1, 0.7, 0.1, 0.1])
            .unwrap();
        assert!(matches!(
            r.push_row(1, &[2], &[1.0]),
            Err(RoutingError::ProbsMixed)
        ));
        assert_eq!(r.probs(0).unwrap()[1], 0.7);
    }
}
