//! The engine's instantiation of the core: an architecture's forward pass (`arch::Model`) as a
//! `bmoe_core::Backend` whose experts live in the arena (filled by the O_DIRECT lanes) or, for
//! the resident baseline, in the model's memory map; the flash device behind it (`Device`);
//! and the expert layout the architecture's tensors describe.
//!
//! The resident run and the streamed runs go through the same decode step: the resident one
//! over `ResidentFlash`, which reads nothing, with every expert computed from the map. The
//! backend runs exactly the same arithmetic either way — same kernels, same order, same bytes
//! (the arena holds the file's bytes verbatim) — which is why a streamed run's output is
//! byte-identical to the resident one for every lossless setting.

use crate::arch::{Arch, ArchError, ExpertJob, KvSnapshot, Model, RouteOut, State};
use crate::arena::{Arena, ArenaError, ArenaOptions, Extent, SlotAddr};
use crate::flash::LaneFlash;
use bmoe_core::faults::FaultyFlash;
use bmoe_core::faults::RetryFlash;
use bmoe_core::{
    Backend, ExpertLayout, ExpertUse, Flash, FlashError, LayerId, LayoutError, MoeLayerLayout,
    Prediction, ProjExtent, ReadDone, ReadId, ReadRequest, ResidentFlash, Routing, SeqRun,
    Sequences, SlotId, StepInput,
};
use std::sync::Arc;

/// The engine's flash device: the O_DIRECT lanes (which inject `--inject-faults` and time
/// reads out), behind the core's retry of EIO and short reads, behind the single-read spoiler
/// of `--inject-read-fault` (which spoils nothing unless asked to), or — without `--moe-stream` — the
/// resident device, which holds every expert in the model's map and reads nothing.
pub enum Device {
    Lanes(FaultyFlash<RetryFlash<LaneFlash>>),
    Resident(ResidentFlash),
}

impl Flash for Device {
    fn lanes(&self) -> u32 {
        match self {
            Device::Lanes(f) => f.lanes(),
            Device::Resident(f) => f.lanes(),
        }
    }
    fn submit(&mut self, read: ReadRequest) -> ReadId {
        match self {
            Device::Lanes(f) => f.submit(read),
            Device::Resident(f) => f.submit(read),
        }
    }
    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        match self {
            Device::Lanes(f) => f.wait(id),
            Device::Resident(f) => f.wait(id),
        }
    }
    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        match self {
            Device::Lanes(f) => f.poll(),
            Device::Resident(f) => f.poll(),
        }
    }
    fn cancel(&mut self, id: ReadId) -> bool {
        match self {
            Device::Lanes(f) => f.cancel(id),
            Device::Resident(f) => f.cancel(id),
        }
    }
    fn resident(&self) -> bool {
        matches!(self, Device::Resident(_))
    }
}

/// Errors of the streamed backend.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Arch(#[from] ArchError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Arena(#[from] ArenaError),
    #[error("router output: {0}")]
    Routing(#[from] bmoe_core::RoutingError),
    #[error(transparent)]
    Follow(#[from] bmoe_core::hooks::follow::FollowError),
    #[error("--compute-trace: {0}")]
    Trace(std::io::Error),
    #[error("--mtp-logits-out: {0}")]
    MtpLogits(std::io::Error),
    #[error("layer {layer} expert {expert}: asked to compute an expert slot no read ever filled")]
    EmptySlot { layer: u32, expert: u16 },
    #[error(transparent)]
    NonFinite(#[from] crate::finite::NonFiniteLogits),
    /// `--verify-reads`: the bytes a read landed are not the file's (torn or stale).
    #[error("layer {layer} expert {expert} projection {proj}: the bytes read do not match the checksum sidecar (xxh3 {got:016x}, expected {expected:016x}): a torn or stale read")]
    ChecksumMismatch {
        layer: u32,
        expert: u16,
        proj: usize,
        expected: u64,
        got: u64,
    },
}

/// The expert layout of a loaded model: per MoE layer the (shard, offset, stride) of each
/// stacked expert projection in read order, and the layer's resident bytes (attention, norms,
/// router, shared experts, per-expert biases and scales).
pub fn layout_of<A: Arch + ?Sized>(model: &Model<A>) -> Result<ExpertLayout, StreamError> {
    let dims = model.dims();
    let w = model.arch.weights();
    let layers = model
        .arch
        .moe_layers()
        .iter()
        .map(|m| MoeLayerLayout {
            model_layer: m.layer as u32,
            n_expert: dims.n_expert as u32,
            projections: m
                .projections
                .iter()
                .map(|x| ProjExtent {
                    shard: x.info.shard,
                    base_offset: x.info.offset,
                    stride_bytes: x.stride,
                })
                .collect(),
            dense_bytes: w.layer_dense_bytes(m.layer),
        })
        .collect();
    Ok(ExpertLayout::new(
        dims.n_layer as u32,
        layers,
        dims.n_expert_used as u16,
    )?)
}

/// The arena for a layout: one canonical slot per (layer, expert), plus staging slots for
/// the cache-off mode (as many as a layer has experts: `SlotId::Staging(i)` is a place in the
/// layer's union of routed experts, which `--load-all` makes every expert), committed as
/// `opts` says.
pub fn arena_for(layout: &ExpertLayout, opts: ArenaOptions) -> Result<Arena, StreamError> {
    let layers: Vec<(u32, Vec<u64>)> = layout
        .layers()
        .iter()
        .map(|l| {
            (
                l.n_expert,
                l.projections.iter().map(|p| p.stride_bytes).collect(),
            )
        })
        .collect();
    Ok(Arena::with_options(&layers, layout.max_n_expert(), opts)?)
}

/// Most projections an expert has (gate, up, down, and room for biases or scales).
const MAX_PROJ: usize = 8;

/// `--mtp`'s draft head at work (see [`EngineBackend::enable_mtp`]).
struct MtpRun {
    /// The head's own state: the memory of its one attention layer, and its buffers.
    state: State,
    /// The step in flight's tokens.
    tokens: Vec<u32>,
    /// The last step's first position and each of its rows' normed final hidden state
    /// (llama.cpp's `h_nextn`): the `h` a row at the position after it pairs with.
    last_first: u32,
    last_h: Vec<f32>,
    /// The last row's position and hidden state of the last few steps before that, each still
    /// of the context's history (a step drops those at or past its first position): a turn
    /// that continues from a turn boundary (a regenerated or edited reply) finds the hidden
    /// state of the position before it here.
    ends: Vec<(u32, Vec<f32>)>,
    /// The last step's rows the head has not caught up with: tokens, positions, and each
    /// row's `h` (the hidden state of the position before it).
    pending: Option<(Vec<u32>, Vec<u32>, Vec<f32>)>,
    h: Vec<f32>,
    h_out: Vec<f32>,
    /// `--mtp-logits-out`.
    logits_out: Option<std::io::BufWriter<std::fs::File>>,
}

impl MtpRun {
    fn new(state: State, logits_out: Option<std::io::BufWriter<std::fs::File>>) -> MtpRun {
        MtpRun {
            state,
            tokens: Vec::new(),
            last_first: 0,
            last_h: Vec::new(),
            ends: Vec::new(),
            pending: None,
            h: Vec::new(),
            h_out: Vec::new(),
            logits_out,
        }
    }

    /// The trunk's hidden state at position `p` into `h`, replacing it (zeros when the last
    /// step did not hold it: position −1, or a session that moved elsewhere; the draft is then
    /// only worse, never wrong: verification decides).
    fn h_after(&mut self, p: i64, d: usize) {
        let rows = (self.last_h.len() / d.max(1)) as i64;
        let r = p - i64::from(self.last_first);
        self.h.clear();
        if p >= 0 && (0..rows).contains(&r) {
            let r = r as usize;
            self.h.extend_from_slice(&self.last_h[r * d..(r + 1) * d]);
        } else if let Some((_, h)) = self.ends.iter().find(|(q, _)| i64::from(*q) == p) {
            self.h.extend_from_slice(h);
        } else {
            self.h.extend(std::iter::repeat_n(0.0, d));
        }
    }

    /// A step from position `first` computed `rows` (each row's hidden state): it becomes the
    /// last step, and the one before it leaves its last row in `ends`.
    fn step_done(&mut self, first: u32, rows: Vec<f32>, d: usize) {
        const ENDS: usize = 8;
        if self.last_h.len() >= d && d > 0 {
            let n = (self.last_h.len() / d) as u32;
            let last = self.last_h.split_off(self.last_h.len() - d);
            self.ends.push((self.last_first + n - 1, last));
        }
        // What a step rewrites is no longer the context's.
        self.ends.retain(|(q, _)| *q < first);
        if self.ends.len() > ENDS {
            self.ends.drain(..self.ends.len() - ENDS);
        }
        self.last_first = first;
        self.last_h = rows;
    }
}

/// The forward pass with its experts in the arena, or (resident) in the model's map. Generic
/// over the architecture; `EngineBackend` alone is the one `bmoe-cli` runs, whichever
/// architecture the file names.
pub struct EngineBackend<A: Arch + ?Sized = dyn Arch> {
    pub model: Model<A>,
    pub state: State,
    /// `None`: the resident baseline; every expert is computed from the model's map.
    arena: Option<Arc<Arena>>,
    layout: ExpertLayout,
    ro: RouteOut,
    ids: Vec<u16>,
    pred_ids: Vec<u32>,
    uses: Vec<(u32, u16, f32)>,
    /// Resident: the layer's experts the core handed over (id, and the range of its uses in
    /// `deferred_uses`), computed together at `finish_layer` ([`Model::experts_together`]: a
    /// few rounds of the pool per layer instead of a few per expert). The contract lets a
    /// backend defer an expert's work until the layer's `finish_layer`; the bits are the same
    /// as computing each at once.
    deferred: Vec<(u16, std::ops::Range<usize>)>,
    /// The deferred experts' (FFN row, rank, weight) uses, expert after expert.
    deferred_uses: Vec<(u32, u16, f32)>,
    /// Produce logits for every row of the next batch (for `--logits-out`), not just the last.
    pub all_logits: bool,
    /// A speculative verify decode's logits at every row (`Backend::logits_at_every_row`).
    verify_rows: bool,
    /// Rows of the previous step (0 before the first).
    last_batch: u32,
    /// The running step, named for errors (`prefill step (positions 0..=7)`).
    step: String,
    /// `--verify-reads`: the sidecar's checksums, and per (MoE layer, expert) whether its
    /// canonical slot was checked since it was last filled.
    verify: Option<(crate::checksum::ExpertSums, Vec<Vec<bool>>)>,
    /// The decide prefix state (`Backend::keep_prefix`), when one is kept.
    kept: Option<KvSnapshot>,
    /// `--mtp`: the model's MTP head as the draft source ([`EngineBackend::enable_mtp`]).
    mtp: Option<Box<MtpRun>>,
    /// `--routing-from`: the recorded routing the router follows, and the run's index of the
    /// current step's first token (tokens computed before it).
    follow: Option<bmoe_core::hooks::follow::FollowTrace>,
    first_token: u64,
    tokens_begun: u64,
    /// `Sequences::logits_at_rows`: the rows whose logits the head computes (empty: the
    /// last, or every row).
    out_rows: Vec<u32>,
}

impl<A: Arch + ?Sized> EngineBackend<A> {
    /// A backend computing experts from `arena` (streamed), or from the model's map when
    /// `arena` is `None` (resident, over `Device::Resident`).
    pub fn new(
        model: Model<A>,
        state: State,
        arena: Option<Arc<Arena>>,
        layout: ExpertLayout,
    ) -> EngineBackend<A> {
        EngineBackend {
            model,
            state,
            arena,
            layout,
            ro: RouteOut::default(),
            ids: Vec::new(),
            pred_ids: Vec::new(),
            uses: Vec::new(),
            deferred: Vec::new(),
            deferred_uses: Vec::new(),
            all_logits: false,
            verify_rows: false,
            last_batch: 0,
            step: String::new(),
            verify: None,
            kept: None,
            mtp: None,
            follow: None,
            first_token: 0,
            tokens_begun: 0,
            out_rows: Vec::new(),
        }
    }

    /// `--mtp`: draft with the model's MTP head (`Backend::head_logits`). Every step then
    /// keeps each row's final hidden state (the last layer's FFN runs for every row) and the
    /// head catches up on the step's rows before it next drafts, as llama.cpp's draft context
    /// does. An error names a model without a head this build runs.
    /// `logits_out` (`--mtp-logits-out`, a test hook): the head catches up on each step at
    /// once and writes the logits of every row there, as f32 rows.
    pub fn enable_mtp(&mut self, logits_out: Option<&std::path::Path>) -> Result<(), StreamError> {
        let n_ctx = self.state.n_ctx;
        let state = self.model.new_mtp_state(n_ctx).ok_or_else(|| {
            let arch = self.model.arch.name();
            let file = self.model.arch.weights().file();
            let key = format!("{arch}.nextn_predict_layers");
            let blocks = file.get(&key).and_then(|v| v.as_u64()).unwrap_or(0);
            StreamError::Arch(crate::arch::ArchError::Key {
                file: file.path().display().to_string(),
                key,
                what: if blocks > 0 {
                    format!("is {blocks}, but this build does not run {arch}'s MTP block: no head to draft with (--mtp)")
                } else {
                    format!("is 0 or absent: this {arch} file has no MTP head to draft with (--mtp)")
                },
            })
        })?;
        let logits_out = match logits_out {
            Some(p) => Some(std::io::BufWriter::new(
                std::fs::File::create(p).map_err(StreamError::MtpLogits)?,
            )),
            None => None,
        };
        self.state.every_row_out = true;
        self.mtp = Some(Box::new(MtpRun::new(state, logits_out)));
        Ok(())
    }

    /// The MTP head's catch-up on the last step's rows, if it has not run yet: each row's
    /// token with the hidden state of the position before it fills the head's attention
    /// memory at its position (what a draft from a later position attends to).
    fn mtp_catch_up(&mut self) -> Result<(), StreamError> {
        let Some(m) = self.mtp.as_mut() else {
            return Ok(());
        };
        if let Some((tokens, positions, h)) = m.pending.take() {
            let rows: Vec<u32> = match m.logits_out {
                Some(_) => (0..tokens.len() as u32).collect(),
                None => Vec::new(),
            };
            self.model
                .mtp(&mut m.state, &tokens, &positions, &h, &rows, &mut m.h_out)?;
            if let Some(w) = m.logits_out.as_mut() {
                use std::io::Write as _;
                let bytes: Vec<u8> = m
                    .state
                    .logits
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                w.write_all(&bytes)
                    .and_then(|_| w.flush())
                    .map_err(StreamError::MtpLogits)?;
            }
        }
        Ok(())
    }

    /// `--routing-from`: route every token as the recorded trace did (see
    /// `bmoe_core::hooks::follow`).
    pub fn set_follow(&mut self, follow: bmoe_core::hooks::follow::FollowTrace) {
        self.follow = Some(follow);
    }

    /// The recorded routing being followed, if any.
    pub fn follow(&self) -> Option<&bmoe_core::hooks::follow::FollowTrace> {
        self.follow.as_ref()
    }

    /// `--verify-reads`: check every expert's bytes against `sums` before its first compute
    /// after a read (staging slots, refilled every layer, on every compute).
    pub fn set_verify(&mut self, sums: crate::checksum::ExpertSums) {
        let checked = self
            .layout
            .layers()
            .iter()
            .map(|l| vec![false; l.n_expert as usize])
            .collect();
        self.verify = Some((sums, checked));
    }

    /// Computes the experts `expert` deferred for model layer `m` (resident: their bytes are
    /// the map's).
    fn run_deferred(&mut self, m: usize) -> Result<(), StreamError> {
        if self.deferred.is_empty() {
            return Ok(());
        }
        let model = &self.model;
        // Deferred only where the layer is batchable, so its experts split (gate, up, down).
        let projs: Option<Vec<[&[u8]; 3]>> = self
            .deferred
            .iter()
            .map(|(e, _)| model.resident_job_proj(m, *e as usize))
            .collect();
        let Some(projs) = projs else {
            self.deferred.clear();
            self.deferred_uses.clear();
            return Err(StreamError::Arch(ArchError::Tensor {
                file: String::new(),
                tensor: format!("blk.{m} experts"),
                what: "projections not a gated FFN's".into(),
            }));
        };
        let mut jobs: Vec<ExpertJob<'_>> = self
            .deferred
            .iter()
            .zip(projs)
            .map(|((e, uses), proj)| ExpertJob {
                expert: *e as usize,
                proj,
                uses: &self.deferred_uses[uses.clone()],
            })
            .collect();
        // The experts with the most rows first: the threads claim a round's tasks in order,
        // so its last tasks are the shortest and the threads finish close together. Each
        // output row lands in its own slot, so the order changes no bits.
        jobs.sort_by_key(|j| std::cmp::Reverse(j.uses.len()));
        let r = self.model.experts_together(&mut self.state, m, &jobs);
        drop(jobs);
        self.deferred.clear();
        self.deferred_uses.clear();
        Ok(r?)
    }

    fn extent(&self, layer: u16, expert: u16, p: usize) -> Extent {
        let pe = &self.layout.layers()[layer as usize].projections[p];
        Extent {
            shard: pe.shard,
            offset: pe.base_offset + expert as u64 * pe.stride_bytes,
            len: pe.stride_bytes,
        }
    }
}

/// `--verify-reads`: the check of one expert's freshly read bytes (see `set_verify`).
fn check_sums(
    verify: &mut Option<(crate::checksum::ExpertSums, Vec<Vec<bool>>)>,
    layer: LayerId,
    expert: u16,
    slot: SlotId,
    proj: &[&[u8]],
) -> Result<(), StreamError> {
    let Some((sums, checked)) = verify.as_mut() else {
        return Ok(());
    };
    let fresh = match slot {
        SlotId::Canonical(key) => checked
            .get_mut(key.layer as usize)
            .and_then(|v| v.get_mut(key.expert as usize))
            .map(|c| !std::mem::replace(c, true))
            .unwrap_or(true),
        SlotId::Staging(_) => true,
    };
    if !fresh {
        return Ok(());
    }
    let key = bmoe_core::ExpertKey {
        layer: layer.moe,
        expert,
    };
    for (p, bytes) in proj.iter().enumerate() {
        let got = crate::checksum::hash(bytes);
        let expected = sums.get(key, p).unwrap_or(!got);
        if got != expected {
            if let SlotId::Canonical(k) = slot {
                checked[k.layer as usize][k.expert as usize] = false;
            }
            return Err(StreamError::ChecksumMismatch {
                layer: layer.model,
                expert,
                proj: p,
                expected,
                got,
            });
        }
    }
    Ok(())
}

impl<A: Arch + ?Sized> Backend for EngineBackend<A> {
    type Error = StreamError;

    fn begin(&mut self, tokens: &[u32], positions: &[u32]) -> Result<(), StreamError> {
        let n = tokens.len() as u32;
        let grouped: usize = self.state.groups.iter().map(|g| g.2).sum();
        if !self.state.groups.is_empty() && grouped != n as usize {
            return Err(StreamError::Arch(ArchError::Key {
                file: String::new(),
                key: "sequence".into(),
                what: format!("the step has {n} rows but its sequences' runs name {grouped}"),
            }));
        }
        if let (Some(arena), true) = (&self.arena, n == 1 && self.last_batch > 1) {
            // Decoding starts: its steps read at most top-k experts per layer into staging
            // (cache off); what the wider prefill union committed past that goes back. No
            // read is in flight between steps.
            arena.trim_staging(u32::from(self.layout.n_expert_used()));
        }
        self.last_batch = n;
        // The head catches up on the last step before this one moves the trunk on.
        self.mtp_catch_up()?;
        if let Some(m) = self.mtp.as_mut() {
            m.tokens.clear();
            m.tokens.extend_from_slice(tokens);
        }
        // A step that failed may have left a layer's experts deferred.
        self.deferred.clear();
        self.deferred_uses.clear();
        self.first_token = self.tokens_begun;
        self.tokens_begun += u64::from(n);
        let rows: Vec<u32> = if !self.out_rows.is_empty() {
            if self.out_rows.windows(2).any(|w| w[0] >= w[1])
                || self.out_rows[self.out_rows.len() - 1] >= n
            {
                return Err(StreamError::Arch(ArchError::Key {
                    file: String::new(),
                    key: "logits rows".into(),
                    what: format!(
                        "{:?} are not ascending rows of a {n}-row step",
                        self.out_rows
                    ),
                }));
            }
            self.out_rows.clone()
        } else if self.all_logits || self.verify_rows {
            (0..n).collect()
        } else {
            vec![n - 1]
        };
        Ok(self
            .model
            .begin(&mut self.state, tokens, positions, &rows)?)
    }

    fn dense(&mut self, layer: u32) -> Result<(), StreamError> {
        if let Some(t) = self.state.trace.as_mut() {
            t.layer_starts(layer as i32);
        }
        self.model.dense(&mut self.state, layer as usize)?;
        // What of the layer's non-expert part the finer marks did not name: a dense FFN, a
        // shared expert, the checks.
        self.state.mark(layer as usize, "DENSE", "dense");
        Ok(())
    }

    fn route(&mut self, layer: LayerId, routing: &mut Routing) -> Result<(), StreamError> {
        let m = layer.model as usize;
        self.state.mark(m, "WAIT", "wait");
        self.model.route(&mut self.state, m, &mut self.ro)?;
        self.state.mark(m, "ROUTER", "ffn_moe_router");
        let k = self.ro.k;
        let ne = self.model.dims().n_expert;
        if let Some(b) = self.model.arch.selection_bias(layer.model as usize) {
            routing.set_selection_bias(b);
        }
        for (i, &row) in self.ro.rows.iter().enumerate() {
            self.ids.clear();
            self.ids
                .extend(self.ro.ids[i * k..(i + 1) * k].iter().map(|&e| e as u16));
            routing.push_row_with_probs(
                row,
                &self.ids,
                &self.ro.weights[i * k..(i + 1) * k],
                &self.ro.probs[i * ne..(i + 1) * ne],
            )?;
        }
        if let Some(f) = &mut self.follow {
            f.apply(layer.moe, self.first_token, routing)?;
        }
        Ok(())
    }

    fn expert(
        &mut self,
        layer: LayerId,
        expert: u16,
        slot: SlotId,
        uses: &[ExpertUse],
    ) -> Result<(), StreamError> {
        let m = layer.model as usize;
        self.state.mark(m, "WAIT", "wait");
        let deferred = self.deferred.len();
        self.compute_expert(layer, expert, slot, uses)?;
        if self.deferred.len() == deferred {
            if let Some(t) = self.state.trace.as_mut() {
                t.mark_expert(m as i32, expert);
            }
        }
        Ok(())
    }

    fn finish_layer(&mut self, layer: LayerId) -> Result<(), StreamError> {
        let m = layer.model as usize;
        self.state.mark(m, "WAIT", "wait");
        let deferred = !self.deferred.is_empty();
        self.run_deferred(m)?;
        if deferred {
            // Resident: the layer's experts computed together (ggml's MUL_MAT_ID).
            self.state.mark(m, "MOE", "ffn_moe");
        }
        self.model.finish_layer(&mut self.state, m)?;
        self.state.mark(m, "ADD", "ffn_out");
        Ok(())
    }

    fn begin_step(&mut self, input: &StepInput<'_>) -> Result<(), StreamError> {
        self.step = crate::finite::describe(input);
        if let Some(t) = self.state.trace.as_mut() {
            let phase = match input.phase {
                bmoe_core::records::Phase::Prefill => 0,
                bmoe_core::records::Phase::Decode => 1,
            };
            t.begin(
                input.turn,
                phase,
                input.positions.first().copied().unwrap_or(0),
            );
        }
        self.begin(input.tokens, input.positions)?;
        if let Some(t) = self.state.trace.as_mut() {
            t.mark(-1, "GET_ROWS", "embd");
        }
        Ok(())
    }

    fn head(&mut self) -> Result<(), StreamError> {
        if let Some(t) = self.state.trace.as_mut() {
            t.head_starts();
        }
        self.model.head(&mut self.state)?;
        if let Some(t) = self.state.trace.as_mut() {
            t.mark(-1, "HEAD", "result_output");
            t.end();
            t.flush_step().map_err(StreamError::Trace)?;
        }
        // NaN logits would sample token 0 forever and exit 0: stop, naming the step.
        crate::finite::check_logits_of(&self.state.logits, || self.step.clone())?;
        if let Some(m) = self.mtp.as_mut() {
            // Every row's hidden state (`h_nextn`: the final norm of the residual), and the
            // head's catch-up input: row r pairs with the hidden state of the row before.
            let c = self.model.arch.common();
            let d = c.dims.d_model;
            let st = &self.state;
            let all: Vec<u32> = (0..st.n_rows as u32).collect();
            let mut rows = Vec::new();
            crate::arch::blocks::rms_norm_rows(
                &st.x,
                d,
                &all,
                Some(&c.output_norm),
                c.rms_eps,
                &mut rows,
            );
            let first = st.positions.first().copied().unwrap_or(0);
            m.h_after(i64::from(first) - 1, d);
            m.h.extend_from_slice(&rows[..rows.len().saturating_sub(d)]);
            m.pending = Some((
                std::mem::take(&mut m.tokens),
                st.positions.clone(),
                std::mem::take(&mut m.h),
            ));
            m.step_done(first, rows, d);
            if m.logits_out.is_some() {
                self.mtp_catch_up()?;
            }
        }
        Ok(())
    }

    /// `target`'s router (f32 GEMV on the router matrix, the same path `route` takes) on the
    /// router input `route(from)` kept for the batch's last row; see `Model::predict`.
    fn predict(
        &mut self,
        from: LayerId,
        target: LayerId,
        k: usize,
        out: &mut Prediction,
    ) -> Result<bool, StreamError> {
        out.clear();
        let ok = self.model.predict(
            &mut self.state,
            from.model as usize,
            target.model as usize,
            k,
            &mut self.pred_ids,
            &mut out.weights,
        )?;
        if !ok {
            out.clear();
            return Ok(false);
        }
        out.ids.extend(self.pred_ids.iter().map(|&e| e as u16));
        Ok(true)
    }

    fn release(&mut self, slot: SlotId) -> Result<(), StreamError> {
        if let SlotId::Canonical(key) = slot {
            if let Some(arena) = &self.arena {
                arena.release(key.layer as usize, key.expert as u32);
            }
            if let Some((_, checked)) = self.verify.as_mut() {
                if let Some(c) = checked
                    .get_mut(key.layer as usize)
                    .and_then(|v| v.get_mut(key.expert as usize))
                {
                    *c = false;
                }
            }
        }
        Ok(())
    }

    /// The last batch row's logits: the last `n_vocab` of the head's output (every row's
    /// under `all_logits`).
    fn last_logits(&self) -> Option<&[f32]> {
        let n_vocab = self.model.dims().n_vocab;
        let l = &self.state.logits;
        (n_vocab > 0 && l.len() >= n_vocab).then(|| &l[l.len() - n_vocab..])
    }

    fn reusable_prefix(&self, n: u32) -> u32 {
        self.state.reusable_prefix(n as usize) as u32
    }

    /// Whether any layer holds a recurrent state (lfm2moe's convolutions, qwen35moe's delta
    /// rule), which stands only where the last step ended.
    fn keeps_prefix_where_it_stands(&self) -> bool {
        self.state
            .mem
            .iter()
            .any(|m| matches!(m, crate::arch::Memory::Recurrent(_)))
    }

    /// A copy of every layer's KV rows `0..n`, and of a recurrent state standing at `n`.
    fn keep_prefix(&mut self, n: u32) -> Result<Option<u64>, StreamError> {
        // A sliding-window ring fed far past `n` no longer holds the window before it: such a
        // copy could not be continued from, so none is kept (the next decide feeds it all).
        if self.state.reusable_prefix(n as usize) != n as usize {
            self.kept = None;
            return Ok(None);
        }
        let mut snap = self.kept.take().unwrap_or_default();
        self.state.snapshot_kv(n as usize, &mut snap)?;
        let bytes = snap.bytes();
        self.kept = Some(snap);
        Ok(Some(bytes))
    }

    fn logits_at_every_row(&mut self, on: bool) {
        self.verify_rows = on;
        self.state.keep_rows(on);
    }

    /// Every row's logits are a one-token decode's bits (the kernels are row-invariant, and a
    /// recurrent layer folds a batch in token by token), attention rows past the accepted
    /// ones are simply fed again, and a recurrent layer keeps its state after each row of a
    /// verify decode (`State::keep_rows`) for the next step to start from.
    fn verifies_rows(&self) -> bool {
        true
    }

    fn has_draft_head(&self) -> bool {
        self.mtp.is_some()
    }

    /// The head on `token` at `position`: paired with the trunk's hidden state of the
    /// position before (after catching up on the last step) or, `chained`, with the head's
    /// own from its last call.
    fn head_logits(
        &mut self,
        token: u32,
        position: u32,
        chained: bool,
    ) -> Result<Option<&[f32]>, StreamError> {
        if !chained {
            self.mtp_catch_up()?;
        }
        let d = self.model.dims().d_model;
        let Some(m) = self.mtp.as_mut() else {
            return Ok(None);
        };
        if chained {
            std::mem::swap(&mut m.h, &mut m.h_out);
        } else {
            m.h_after(i64::from(position) - 1, d);
        }
        let MtpRun {
            state, h, h_out, ..
        } = &mut **m;
        self.model
            .mtp(state, &[token], &[position], h, &[0], h_out)?;
        crate::finite::check_logits_of(&state.logits, || {
            format!("MTP draft at position {position}")
        })?;
        Ok(Some(&state.logits))
    }

    fn mark_boundary(&mut self, n: u32) -> Result<bool, StreamError> {
        Ok(self.state.mark_boundary(n as usize))
    }

    fn restore_prefix(&mut self) -> Result<Option<u32>, StreamError> {
        let Some(snap) = &self.kept else {
            return Ok(None);
        };
        self.state.restore_kv(snap)?;
        Ok(Some(snap.len() as u32))
    }

    fn drop_prefix(&mut self) {
        self.kept = None;
    }
}

/// `serve --parallel`: sequence 0's memory is the state's own, the others sit beside it
/// (`State::seqs`), and a batch's runs of rows name theirs (`State::groups`).
impl<A: Arch + ?Sized> Sequences for EngineBackend<A> {
    fn n_sequences(&self) -> u32 {
        self.state.seqs.len() as u32 + 1
    }

    fn assign_rows(&mut self, runs: &[SeqRun]) -> Result<(), StreamError> {
        let n = self.n_sequences();
        let bad = |what: String| {
            StreamError::Arch(ArchError::Key {
                file: String::new(),
                key: "sequence".into(),
                what,
            })
        };
        let mut next = 0u32;
        for r in runs {
            if r.seq >= n {
                return Err(bad(format!("{} is not held: {n} are", r.seq)));
            }
            if r.first != next || r.rows == 0 {
                return Err(bad(format!(
                    "runs must cover the batch's rows in order: one starts at row {} where {next} was next",
                    r.first
                )));
            }
            next += r.rows;
        }
        if runs.iter().any(|r| r.seq != 0) && !self.model.arch.batches_sequences() {
            return Err(bad(format!(
                "{} holds one sequence at a time (its memory is not reached through the shared attention)",
                self.model.arch.name()
            )));
        }
        self.state.groups.clear();
        // One run of sequence 0 is the plain one-sequence batch.
        if !(runs.len() == 1 && runs[0].seq == 0) {
            self.state.groups.extend(
                runs.iter()
                    .map(|r| (r.seq as usize, r.first as usize, r.rows as usize)),
            );
        }
        Ok(())
    }

    fn seq_reusable_prefix(&self, seq: u32, n: u32) -> u32 {
        self.state.seq_reusable_prefix(seq as usize, n as usize) as u32
    }

    fn logits_at_rows(&mut self, rows: &[u32]) {
        self.out_rows.clear();
        self.out_rows.extend_from_slice(rows);
    }
}

impl<A: Arch + ?Sized> EngineBackend<A> {
    /// Hold `n` sequences (`serve --parallel`), each with a memory of the state's context
    /// size. Refused for a family whose memory the batch cannot split by sequence, and beside
    /// an MTP head (which follows one sequence).
    pub fn set_sequences(&mut self, n: u32) -> Result<(), String> {
        if n > 1 && !self.model.arch.batches_sequences() {
            return Err(format!(
                "{} cannot decode several sequences in one batch yet (a recurrent, latent or compressed memory)",
                self.model.arch.name()
            ));
        }
        if n > 1 && self.mtp.is_some() {
            return Err("--mtp follows one sequence: it cannot run beside --parallel".into());
        }
        let memory: Vec<crate::arch::LayerMemory> = (0..self.model.dims().n_layer)
            .map(|l| self.model.arch.memory(l))
            .collect();
        self.state.set_sequences(&memory, n.max(1) as usize);
        Ok(())
    }
}

impl<A: Arch + ?Sized> EngineBackend<A> {
    /// [`Backend::expert`]'s work: compute expert `expert` of `layer` from `slot` now, or (a
    /// resident batchable layer) defer it to the layer's `finish_layer`.
    fn compute_expert(
        &mut self,
        layer: LayerId,
        expert: u16,
        slot: SlotId,
        uses: &[ExpertUse],
    ) -> Result<(), StreamError> {
        self.uses.clear();
        self.uses
            .extend(uses.iter().map(|u| (u.row, u.rank, u.weight)));
        let m = layer.model as usize;
        let n_proj = self.model.experts(m).len().min(MAX_PROJ);
        let mut proj: [&[u8]; MAX_PROJ] = [&[]; MAX_PROJ];
        if self.arena.is_none() && self.model.experts_batchable(m) {
            // Resident: computed with the layer's other experts at `finish_layer`. (Streamed,
            // an expert is computed as its read lands: its slot may be released mid-layer.)
            let start = self.deferred_uses.len();
            self.deferred_uses.extend_from_slice(&self.uses);
            self.deferred
                .push((expert, start..self.deferred_uses.len()));
            return Ok(());
        }
        let Some(arena) = &self.arena else {
            // Resident: the expert's bytes are the map's; the slot names no memory.
            let w = self.model.arch.weights();
            for (p, x) in proj.iter_mut().zip(self.model.experts(m)) {
                *p = w.expert_bytes(x, expert as usize);
            }
            return Ok(self.model.expert(
                &mut self.state,
                m,
                expert as usize,
                &proj[..n_proj],
                &self.uses,
            )?);
        };
        let addr = match slot {
            SlotId::Canonical(key) => SlotAddr::Canonical(key.expert as u32),
            SlotId::Staging(e) => SlotAddr::Staging(e as u32),
        };
        let l = layer.moe as usize;
        for (p, out) in proj.iter_mut().enumerate().take(n_proj) {
            let ex = self.extent(layer.moe, expert, p);
            // SAFETY: the core calls `expert` only after every read into this slot completed,
            // and no read into it is issued until `finish_layer` (staging) or `release`
            // (canonical).
            match unsafe { arena.proj_bytes(l, addr, p, &ex) } {
                Some(b) => *out = b,
                None => {
                    return Err(StreamError::EmptySlot {
                        layer: layer.model,
                        expert,
                    })
                }
            }
        }
        check_sums(&mut self.verify, layer, expert, slot, &proj[..n_proj])?;
        Ok(self.model.expert(
            &mut self.state,
            m,
            expert as usize,
            &proj[..n_proj],
            &self.uses,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> MtpRun {
        MtpRun::new(State::new(&[], 8), None)
    }

    /// Rows of width 2 whose values are their positions.
    fn rows(first: u32, n: u32) -> Vec<f32> {
        (first..first + n)
            .flat_map(|p| [p as f32, p as f32])
            .collect()
    }

    fn h_at(m: &mut MtpRun, p: i64) -> Vec<f32> {
        m.h_after(p, 2);
        m.h.clone()
    }

    /// The head pairs a row with the trunk's hidden state of the position before it: from the
    /// last step, from an earlier step's last row while the context still holds it, else zeros.
    #[test]
    fn the_hidden_state_before_a_position_comes_from_the_context_it_is_of() {
        let mut m = run();
        assert_eq!(h_at(&mut m, -1), [0.0, 0.0], "before position 0");
        m.step_done(0, rows(0, 5), 2); // a prompt: 0..=4
        assert_eq!(h_at(&mut m, 3), [3.0, 3.0]);
        m.step_done(5, rows(5, 1), 2); // decode 5
        m.step_done(6, rows(6, 3), 2); // a verify group 6..=8
        assert_eq!(h_at(&mut m, 7), [7.0, 7.0], "the last step's rows");
        assert_eq!(h_at(&mut m, 4), [4.0, 4.0], "the prompt's last row, kept");
        assert_eq!(h_at(&mut m, 5), [5.0, 5.0]);
        assert_eq!(
            h_at(&mut m, 2),
            [0.0, 0.0],
            "not kept: only each step's last row"
        );
        // A step that goes back to 5 rewrites the context from there: what was at 5 and past
        // it is another history now.
        m.step_done(5, rows(105, 2), 2);
        assert_eq!(h_at(&mut m, 5), [105.0, 105.0]);
        assert_eq!(
            h_at(&mut m, 8),
            [0.0, 0.0],
            "the old group's last row is gone"
        );
        assert_eq!(h_at(&mut m, 4), [4.0, 4.0]);
    }
}
