//! Speculative prefetch, driven by the streamer: `--prefetch K` (previous-token temporal
//! prefetch, features.md §4) and the predicted candidates of `predict.rs` — `--predict-prefetch`
//! (stale-gate, capped per layer, retention only at cap 0) and route-ahead's early reads of the
//! committed routing (no cap, never cancelled). One machinery, several candidate sources.
//!
//! `--prefetch K` in detail:
//! While layer `l` of a decode token computes, the streamer asks this module to read ahead the
//! experts the **previous** token routed at layers `l+1 … l+K` that are not resident (for the
//! first decode token: the last prompt token's routing). Speculation is written so that it can
//! never change what a token computes, only when bytes arrive:
//!
//! - a speculative read is the demand read (same offsets, same split, same destination slot);
//!   its expert is admitted to the cache like a miss — within the budget, evicting only
//!   unpinned entries by policy — and stays pinned while any of its reads is in flight, so its
//!   slot is never evicted or released under a landing read;
//! - only the core loop touches the cache; completions are accounted when the core polls or
//!   waits, never on a lane;
//! - at the real load of an entry's own layer it is settled: needed → its pin is handed to the
//!   routing (the lookup hits, residency 2) and reads still in flight are adopted by the layer
//!   as if they were its own demand reads (their failure is the layer's failure); not needed →
//!   its queued reads are cancelled, started ones waited for, and it is kept when every
//!   projection landed, discarded otherwise;
//! - demand pre-empts speculation: before a layer submits its demand reads, queued reads of
//!   entries for later layers are cancelled and resubmitted behind the demand; a demand miss
//!   that finds no room beside speculative pins abandons the farthest speculation first;
//! - a failed speculative read the layer does not need drops its entry, nothing more.
//!
//! Every entry targets a layer of the same token, so nothing speculative is in flight between
//! steps. On the simulator and `testing::MemFlash` the outcome is a function of the inputs; on
//! real lanes whether a queued read could still be cancelled depends on timing, which may
//! change which unneeded entries are kept (never the computed bytes).

use crate::backend::{Backend, BackendStage, Routing, SlotId};
use crate::cache::Admission;
use crate::cache::ExpertCache;
use crate::clock::{Clock, Nanos};
use crate::flash::{Flash, FlashError, ReadDone, ReadId, ReadRequest, ReadTag};
use crate::layout::ExpertLayout;
use crate::layout::{ExpertKey, MoeLayerLayout};
use crate::predict::{PredictConfig, SpecTarget};
use crate::records::IoRecord;
use crate::records::{Phase, RecordSink, PRED_HORIZON_MAX};
use crate::vocab::{be, ReadSplit, StepError};
use crate::vocab::{StepStats, StreamConfig};

/// Everything the streamer touches while it runs one layer, borrowed from the engine. It lives
/// here, below the streamer, because the prefetcher reads and accounts through it too.
pub(crate) struct LayerIo<'a, C, F, B> {
    pub clock: &'a C,
    pub flash: &'a mut F,
    pub backend: &'a mut B,
    pub cache: &'a mut ExpertCache,
    pub layout: &'a ExpertLayout,
    pub config: &'a StreamConfig,
    pub sink: &'a mut dyn RecordSink,
    pub stats: &'a mut StepStats,
    pub turn: u32,
    pub phase: Phase,
    pub positions: &'a [u32],
    /// The MoE layer being streamed (set by `run_layer`).
    pub layer_moe: u16,
    /// The armed predictors (`--prefetch-sync` rides here too).
    pub predict: &'a PredictConfig,
    /// This layer's predicted speculation (`--predict-prefetch`, route-ahead's early reads).
    pub spec: &'a [SpecTarget],
    /// Per routing slot of the batch's last row (decode): the predictions recorded in the
    /// route trace (`RouteRecord::preds`). Empty when none were made.
    pub trace_preds: &'a [[Option<(u16, f32)>; PRED_HORIZON_MAX]],
    /// Route-ahead committed this layer's last row: the router's own ids per slot
    /// (`RouteRecord::router_expert`). Empty otherwise.
    pub router_ids: &'a [u16],
}

/// Every read of one expert: each projection extent cut as `split` says, lanes round-robin
/// from `lane_cursor`. Demand and speculation both use this, which
/// is what makes a speculative read equal to the demand read.
#[allow(clippy::too_many_arguments)] // a hot-path helper; a parameter struct buys nothing
pub(crate) fn expert_reads(
    layer: &MoeLayerLayout,
    moe: u16,
    expert: u16,
    slot: SlotId,
    split: ReadSplit,
    speculative: bool,
    lanes: u32,
    lane_cursor: &mut u32,
    mut each: impl FnMut(ReadRequest),
) {
    for (proj, p) in layer.projections.iter().enumerate() {
        let base = p.base_offset + u64::from(expert) * p.stride_bytes;
        let chunk = split.piece_bytes(p.stride_bytes, lanes);
        let mut done = 0u64;
        while done < p.stride_bytes {
            let len = chunk.min(p.stride_bytes - done);
            each(ReadRequest {
                shard: p.shard,
                offset: base + done,
                len,
                dest: slot,
                dest_offset: done,
                lane: *lane_cursor,
                speculative,
                tag: ReadTag {
                    layer: moe,
                    expert,
                    proj: proj as u8,
                },
            });
            *lane_cursor = (*lane_cursor + 1) % lanes.max(1);
            done += len;
        }
    }
}

/// Check a delivered outcome against its request (a short read is a failure).
pub(crate) fn checked(
    req: &ReadRequest,
    id: ReadId,
    outcome: Result<ReadDone, FlashError>,
) -> Result<ReadDone, FlashError> {
    let done = outcome?;
    if done.id != id || done.req_bytes != req.len || done.read_bytes < done.req_bytes {
        return Err(FlashError::Short {
            shard: req.shard,
            offset: req.offset,
            expected: req.len,
            got: done.req_bytes.min(done.read_bytes),
        });
    }
    Ok(done)
}

/// Account one successful read in the step's stats and io trace (both demand and speculative).
pub(crate) fn account_read<C, F, B>(
    io: &mut LayerIo<'_, C, F, B>,
    req: &ReadRequest,
    done: &ReadDone,
) {
    io.stats.reads += 1;
    io.stats.read_bytes += done.read_bytes;
    io.stats.req_bytes += done.req_bytes;
    io.stats.lane_busy += done.end - done.start;
    if req.speculative {
        io.stats.spec_reads += 1;
        io.stats.spec_read_bytes += done.read_bytes;
    }
    if io.sink.wants_io() {
        io.sink.io(&IoRecord {
            turn: io.turn,
            phase: io.phase,
            step: io.positions.last().map_or(-1, |&p| i64::from(p)),
            layer: u32::from(req.tag.layer),
            expert: u32::from(req.tag.expert),
            proj: req.tag.proj,
            lane: done.lane,
            speculative: req.speculative,
            offset: req.offset,
            req_bytes: done.req_bytes,
            read_bytes: done.read_bytes,
            latency_ns: (done.end - done.start).0,
        });
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum ReadState {
    /// Submitted; outcome not delivered.
    Live,
    /// Cancelled to let demand pass; resubmitted after the layer's demand reads.
    Requeue,
    /// Delivered or cancelled for good.
    Gone,
}

#[derive(Copy, Clone, Debug)]
struct SpecRead {
    id: ReadId,
    req: ReadRequest,
    state: ReadState,
}

/// One speculatively admitted expert (resident in the cache, pinned once by its admission).
#[derive(Clone, Debug)]
struct SpecEntry {
    key: ExpertKey,
    reads: Vec<SpecRead>,
    /// A read was cancelled for good: the slot will never be complete.
    cancelled: bool,
    /// The first failure among its reads.
    failed: Option<(ReadTag, FlashError)>,
    /// Route-ahead's committed routing: its reads are never cancelled (not pulled back for
    /// demand, not given up while queued); a layer that does not need it waits for them.
    committed: bool,
}

impl SpecEntry {
    fn live(&self) -> usize {
        self.reads
            .iter()
            .filter(|r| r.state == ReadState::Live)
            .count()
    }
    fn complete(&self) -> bool {
        !self.cancelled
            && self.failed.is_none()
            && self.reads.iter().all(|r| r.state == ReadState::Gone)
    }
}

/// A read in flight that a layer adopts as its own (its expert was needed).
#[derive(Copy, Clone, Debug)]
pub(crate) struct Adopted {
    pub id: ReadId,
    pub req: ReadRequest,
}

/// The prefetcher's state across layers and steps.
#[derive(Debug, Default)]
pub(crate) struct Prefetcher {
    horizon: u16,
    /// Per MoE layer: the experts the previous token routed there (not dropped), rank order.
    prev: Vec<Vec<u16>>,
    /// Per key index: admitted speculatively and not yet touched by a routing.
    untouched: Vec<bool>,
    entries: Vec<SpecEntry>,
    evicted: Vec<ExpertKey>,
    /// Per MoE layer: predicted misses admitted for it this step (the `--predict-spec-max` cap).
    issued_for: Vec<u32>,
}

/// What one speculation attempt did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Speculated {
    /// Resident or already speculated: nothing read.
    Present,
    /// Admitted and its reads submitted.
    Issued,
    /// The cache has no room beside its pins: stop speculating this layer.
    NoRoom,
}

impl Prefetcher {
    pub(crate) fn new(horizon: u32, n_moe_layers: u16, n_keys: u32) -> Self {
        Prefetcher {
            horizon: horizon.min(u32::from(u16::MAX)) as u16,
            prev: vec![Vec::new(); n_moe_layers as usize],
            untouched: vec![false; n_keys as usize],
            entries: Vec::new(),
            evicted: Vec::new(),
            issued_for: vec![0; n_moe_layers as usize],
        }
    }

    /// Remember the last batch row's routing of `moe` (the next token's predictor).
    pub(crate) fn record(&mut self, moe: u16, routing: &Routing) {
        let Some(prev) = self.prev.get_mut(moe as usize) else {
            return;
        };
        prev.clear();
        let last = (0..routing.n_rows()).max_by_key(|&r| routing.batch_row(r));
        if let Some(r) = last {
            let dropped = routing.dropped(r);
            for (rank, &e) in routing.ids(r).iter().enumerate() {
                if !dropped[rank] {
                    prev.push(e);
                }
            }
        }
    }

    /// A demand lookup found `key` resident: true (once) when a speculative admission put it
    /// there — residency 2, one useful prefetch.
    pub(crate) fn touch(&mut self, index: u32) -> bool {
        match self.untouched.get_mut(index as usize) {
            Some(u) if *u => {
                *u = false;
                true
            }
            _ => false,
        }
    }

    /// A demand miss admitted `key`: whatever speculation once put there is gone.
    pub(crate) fn forget(&mut self, index: u32) {
        if let Some(u) = self.untouched.get_mut(index as usize) {
            *u = false;
        }
    }

    fn find_read(&self, id: ReadId) -> Option<(usize, usize)> {
        self.entries.iter().enumerate().find_map(|(ei, en)| {
            en.reads
                .iter()
                .position(|r| r.id == id && r.state == ReadState::Live)
                .map(|ri| (ei, ri))
        })
    }

    /// Account an outcome the flash delivered. `Ok(false)` when `id` is not a live
    /// speculative read (the caller decides whether that is an error). A failure is recorded
    /// on the entry, never returned here.
    pub(crate) fn on_complete<C, F, B>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        id: ReadId,
        outcome: Result<ReadDone, FlashError>,
    ) -> bool {
        let Some((ei, ri)) = self.find_read(id) else {
            return false;
        };
        let en = &mut self.entries[ei];
        en.reads[ri].state = ReadState::Gone;
        let req = en.reads[ri].req;
        match checked(&req, id, outcome) {
            Ok(done) => account_read(io, &req, &done),
            Err(e) => {
                io.stats.spec_failed += 1;
                if en.failed.is_none() {
                    en.failed = Some((req.tag, e));
                }
            }
        }
        if en.complete() {
            io.stats.spec_experts += 1;
        }
        true
    }

    /// Wait for every live read of entry `ei` (outcomes accounted, failures recorded).
    fn wait_entry<C: Clock, F: Flash, B>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        ei: usize,
    ) -> Nanos {
        let t = io.clock.now();
        while let Some(r) = self.entries[ei]
            .reads
            .iter()
            .find(|r| r.state == ReadState::Live)
            .copied()
        {
            let outcome = io.flash.wait(r.id);
            self.on_complete(io, r.id, outcome);
        }
        io.clock.now() - t
    }

    /// Cancel every live read of entry `ei` that has not started; `requeue` keeps them for
    /// resubmission instead of giving the entry up.
    fn cancel_entry<F: Flash, C, B>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        ei: usize,
        requeue: bool,
    ) {
        let en = &mut self.entries[ei];
        for r in en.reads.iter_mut().filter(|r| r.state == ReadState::Live) {
            if io.flash.cancel(r.id) {
                io.stats.spec_cancelled += 1;
                if requeue {
                    r.state = ReadState::Requeue;
                } else {
                    r.state = ReadState::Gone;
                    en.cancelled = true;
                }
            }
        }
        if !requeue && en.reads.iter().any(|r| r.state == ReadState::Requeue) {
            en.cancelled = true;
            for r in en.reads.iter_mut() {
                if r.state == ReadState::Requeue {
                    r.state = ReadState::Gone;
                }
            }
        }
    }

    /// Remove entry `ei`: unpin it, and keep it resident when `keep`, else discard and release.
    fn retire<C, F, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        ei: usize,
        keep: bool,
    ) -> Result<(), StepError> {
        let en = self.entries.swap_remove(ei);
        let key = en.key;
        if keep {
            io.cache.unpin(key)?;
        } else {
            io.cache.discard(key)?;
            if let Some(i) = io.layout.key_index(key) {
                self.untouched[i as usize] = false;
            }
            let model = io.layout.layer(key.layer).map_or(0, |l| l.model_layer);
            io.backend
                .release(SlotId::Canonical(key))
                .map_err(be(BackendStage::Release, model))?;
        }
        Ok(())
    }

    fn charge_wait<C, F, B>(io: &mut LayerIo<'_, C, F, B>, waited: Nanos) {
        if io.config.overlap {
            io.stats.stall += waited;
        } else {
            io.stats.io += waited;
        }
    }

    /// Before MoE layer `moe` looks anything up: take in what has landed, settle the entries
    /// for this layer (`needed(expert)` says whether the routing uses it; reads still in flight
    /// of needed ones are appended to `adopt`), and pull back queued reads of entries for later
    /// layers so that the layer's demand reads go first. Entries for earlier layers (none in
    /// normal operation) and, outside decode, all entries are settled as not needed.
    pub(crate) fn begin_layer<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        moe: u16,
        decode: bool,
        needed: impl Fn(u16) -> bool,
        adopt: &mut Vec<Adopted>,
    ) -> Result<(), StepError> {
        while let Some((id, outcome)) = io.flash.poll() {
            if !self.on_complete(io, id, outcome) {
                return Err(StepError::UnexpectedCompletion { id });
            }
        }
        if let Some(n) = self.issued_for.get_mut(moe as usize) {
            *n = 0;
        }
        let mut ei = 0;
        while ei < self.entries.len() {
            let key = self.entries[ei].key;
            let committed = self.entries[ei].committed;
            let mine = decode && key.layer == moe;
            if mine && needed(key.expert) {
                if let Some((tag, source)) = self.entries[ei].failed.clone() {
                    // The layer needs it: its failure is the demand read's failure.
                    let waited = self.wait_entry(io, ei);
                    Self::charge_wait(io, waited);
                    return Err(StepError::Flash { tag, source });
                }
                for r in &self.entries[ei].reads {
                    if r.state == ReadState::Live {
                        adopt.push(Adopted {
                            id: r.id,
                            req: r.req,
                        });
                    }
                }
                // The routing's lookup pins it from here on; the layer owns the reads.
                let t = io.clock.now();
                self.retire(io, ei, true)?;
                io.stats.mgmt += io.clock.now() - t;
                continue;
            }
            if key.layer > moe && decode {
                if !committed {
                    let t = io.clock.now();
                    self.cancel_entry(io, ei, true);
                    io.stats.mgmt += io.clock.now() - t;
                }
                ei += 1;
                continue;
            }
            // Not needed: pull back what has not started (committed reads are never
            // cancelled), wait for what has.
            if !committed {
                let t = io.clock.now();
                self.cancel_entry(io, ei, false);
                io.stats.mgmt += io.clock.now() - t;
            }
            if self.entries[ei].live() > 0 {
                let waited = self.wait_entry(io, ei);
                Self::charge_wait(io, waited);
            }
            let keep = self.entries[ei].complete();
            if !keep {
                io.stats.spec_dropped += 1;
            }
            let t = io.clock.now();
            self.retire(io, ei, keep)?;
            io.stats.mgmt += io.clock.now() - t;
        }
        Ok(())
    }

    /// A demand miss found no room beside the pinned entries: give up the speculation for the
    /// farthest layer (latest issued first). False when there is none to give up.
    pub(crate) fn abandon_farthest<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
    ) -> Result<bool, StepError> {
        // Uncommitted speculation goes first; a committed entry is waited for, not cancelled.
        let Some(ei) = (0..self.entries.len())
            .max_by_key(|&i| (!self.entries[i].committed, self.entries[i].key.layer, i))
        else {
            return Ok(false);
        };
        if !self.entries[ei].committed {
            let t = io.clock.now();
            self.cancel_entry(io, ei, false);
            io.stats.mgmt += io.clock.now() - t;
        }
        if self.entries[ei].live() > 0 {
            let waited = self.wait_entry(io, ei);
            Self::charge_wait(io, waited);
        }
        io.stats.spec_dropped += 1;
        let t = io.clock.now();
        self.retire(io, ei, false)?;
        io.stats.mgmt += io.clock.now() - t;
        Ok(true)
    }

    /// After MoE layer `moe`'s demand reads are submitted: resubmit the reads pulled back by
    /// `begin_layer`, then read ahead what the previous token routed at `moe+1 … moe+K` that
    /// is not resident. Stops at the first expert the cache has no room for.
    pub(crate) fn issue<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        moe: u16,
        lane_cursor: &mut u32,
    ) -> Result<(), StepError> {
        for en in &mut self.entries {
            for r in en
                .reads
                .iter_mut()
                .filter(|r| r.state == ReadState::Requeue)
            {
                r.id = io.flash.submit(r.req);
                r.state = ReadState::Live;
            }
        }
        if io.cache.is_off() {
            return Ok(());
        }
        let last = io.layout.n_moe_layers();
        if self.horizon > 0 {
            let end = (u32::from(moe) + 1 + u32::from(self.horizon)).min(u32::from(last)) as u16;
            for target in moe.saturating_add(1)..end {
                for j in 0..self.prev[target as usize].len() {
                    let expert = self.prev[target as usize][j];
                    if self.speculate(io, target, expert, false, lane_cursor)? == Speculated::NoRoom
                    {
                        return Ok(());
                    }
                }
            }
        }
        // Predicted candidates (`predict.rs`): residents are retained (touched in the policy),
        // misses read up to the target's cap.
        let spec = io.spec;
        for st in spec {
            if st.target >= last || st.target <= moe {
                continue;
            }
            for &expert in &st.experts {
                let key = ExpertKey {
                    layer: st.target,
                    expert,
                };
                if io.cache.contains(key) {
                    io.cache.retain(key);
                    continue;
                }
                let issued = self
                    .issued_for
                    .get(st.target as usize)
                    .copied()
                    .unwrap_or(0);
                if issued >= st.cap {
                    continue;
                }
                match self.speculate(io, st.target, expert, st.committed, lane_cursor)? {
                    Speculated::NoRoom => return Ok(()),
                    Speculated::Issued => {
                        if let Some(n) = self.issued_for.get_mut(st.target as usize) {
                            *n += 1;
                        }
                    }
                    Speculated::Present => {}
                }
            }
        }
        Ok(())
    }

    /// Admit `expert` of MoE layer `target` speculatively and submit its reads (the demand
    /// reads' exact split). Under `--prefetch-sync` the reads are waited for right here, on the
    /// eval thread, so no lane runs concurrently with compute.
    fn speculate<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        target: u16,
        expert: u16,
        committed: bool,
        lane_cursor: &mut u32,
    ) -> Result<Speculated, StepError> {
        let Some(layer) = io.layout.layer(target) else {
            return Ok(Speculated::Present);
        };
        let key = ExpertKey {
            layer: target,
            expert,
        };
        // Resident already, or speculated already: nothing to read.
        if io.cache.contains(key) {
            return Ok(Speculated::Present);
        }
        let Some(index) = io.layout.key_index(key) else {
            return Ok(Speculated::Present);
        };
        let model = layer.model_layer;
        let t = io.clock.now();
        let admission = io.cache.admit(key, &mut self.evicted)?;
        for evicted in self.evicted.drain(..) {
            io.backend
                .release(SlotId::Canonical(evicted))
                .map_err(be(BackendStage::Release, model))?;
        }
        io.stats.mgmt += io.clock.now() - t;
        if admission == Admission::NoRoom {
            return Ok(Speculated::NoRoom);
        }
        self.untouched[index as usize] = true;
        let lanes = io.flash.lanes().max(1);
        let mut reads = Vec::with_capacity(layer.projections.len());
        expert_reads(
            layer,
            target,
            expert,
            SlotId::Canonical(key),
            // Speculation is decode-only and cached: the cut the demand read would use.
            io.config.read_split.resolve(true, true, 0, lanes),
            true,
            lanes,
            lane_cursor,
            |req| {
                let id = io.flash.submit(req);
                reads.push(SpecRead {
                    id,
                    req,
                    state: ReadState::Live,
                });
            },
        );
        io.stats.spec_issued += 1;
        self.entries.push(SpecEntry {
            key,
            reads,
            cancelled: false,
            failed: None,
            committed,
        });
        if io.predict.sync {
            let waited = self.wait_entry(io, self.entries.len() - 1);
            Self::charge_wait(io, waited);
        }
        Ok(Speculated::Issued)
    }

    /// The step failed: wait for every read still in flight (outcomes ignored) so nothing lands
    /// after the step gave up, and forget the entries (the engine is poisoned).
    pub(crate) fn abort<F: Flash>(&mut self, flash: &mut F) {
        for en in self.entries.drain(..) {
            for r in en.reads {
                if r.state == ReadState::Live {
                    let _ = flash.wait(r.id);
                }
            }
        }
    }
}
