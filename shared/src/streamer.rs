//! The streamer: one MoE layer's routed experts, from routing to computed outputs.
//!
//! Given the layer's (hooked) routing it takes the union of the batch's routed experts (each
//! read at most once), looks every one up in the cache (hits pinned first: the admission
//! rule), admits the misses (evicting by policy, releasing what was evicted), issues one read
//! per projection extent round-robin over the flash lanes, and hands each expert to the
//! backend once its bytes have landed — after all of the layer's reads (serial) or as soon as
//! its own reads complete (`--overlap`). It owns the time split the telemetry reports: `io`,
//! `stall` and `mgmt`, all measured with the injected `Clock`.
//!
//! Each lookup and admission carries the expert's routing (`AccessContext`: its rows, best
//! rank and router weights). A miss the policy bypasses (`Admission::Bypassed`) is read into
//! the staging slot of its place in the union, as with the cache off — a transient buffer
//! valid until the layer finishes — computed from there like any other, and never pinned or
//! unpinned.
//!
//! Speculative prefetch (`--prefetch K`, `prefetch.rs`) plugs in at three points of a layer:
//! before the lookups (settle this layer's speculative entries, adopt the reads of needed ones,
//! pull back queued reads for later layers), in admission (a miss with no room beside
//! speculative pins gives up the farthest speculation first) and after the demand reads are
//! submitted (resubmit what was pulled back, read ahead the next layers). A completion the
//! layer did not submit is handed to the prefetcher; one neither knows is refused as
//! `StepError::UnexpectedCompletion`.

use crate::backend::{Backend, BackendStage, ExpertUse, LayerId, Routing, SlotId};
use crate::cache::{Admission, Lookup};
use crate::clock::Clock;
use crate::flash::{Flash, FlashError, ReadDone, ReadId, ReadRequest};
use crate::layout::{ExpertKey, ExpertLayout};
use crate::policy::AccessContext;
use crate::prefetch::{account_read, checked, expert_reads, Adopted, LayerIo, Prefetcher};
use crate::records::{Phase, RouteRecord};
use crate::vocab::{be, StepError};
use std::collections::VecDeque;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum EntryState {
    /// A miss not yet admitted (a later wave).
    Waiting,
    /// Admitted; reads outstanding.
    Reading,
    /// Bytes resident; not yet computed.
    Ready,
    /// Computed (or needed no compute).
    Done,
}

/// One expert of the layer's union.
#[derive(Copy, Clone, Debug)]
struct Entry {
    expert: u16,
    slot: SlotId,
    hit: bool,
    state: EntryState,
    /// This expert's uses are `uses[uses_start .. uses_start + uses_len]`, sorted by
    /// (row, rank). Zero uses: read only because of `--load-all`.
    uses_start: u32,
    uses_len: u32,
    fill: u32,
    pending_reads: u32,
    bytes_traced: bool,
    /// A hit on a speculative admission's first touch (route-trace residency 2).
    spec_touch: bool,
    /// Its reads were speculative ones this layer adopted.
    adopted: bool,
    /// A miss the policy bypassed: read into `Staging` and computed from there, not in the
    /// cache (never pinned, so never unpinned).
    bypassed: bool,
    /// Its routing in this layer, for the policy.
    access: AccessContext,
}

/// A submitted read of this layer: its own demand read, or a speculative one it adopted
/// (`req.speculative`). Written once per read on the replay hot path.
#[derive(Copy, Clone, Debug)]
struct InFlight {
    id: ReadId,
    req: ReadRequest,
    entry: u32,
    delivered: bool,
}

/// Reusable per-layer scratch. No allocation once capacities have grown.
#[derive(Debug, Default)]
pub(crate) struct Streamer {
    /// Per expert id: `epoch` when it joined this layer's union.
    stamp: Vec<u32>,
    /// Per expert id: its position in `entries` (valid when stamped this epoch).
    pos_of: Vec<u32>,
    epoch: u32,
    entries: Vec<Entry>,
    uses: Vec<ExpertUse>,
    misses: Vec<u32>,
    /// Entries pinned by the current wave (serial) or window (overlap), in admission order.
    wave: Vec<u32>,
    /// `wave[..unpinned]` are unpinned already (the window's computed head).
    unpinned: usize,
    ready: VecDeque<u32>,
    inflight: Vec<InFlight>,
    oldest: usize,
    outstanding: usize,
    evicted: Vec<ExpertKey>,
    /// The keys of the misses a wave tries to admit (reused: no allocation per layer).
    admit_keys: Vec<(ExpertKey, AccessContext)>,
    lane_cursor: u32,
    /// `--prefetch`: made on the first layer that runs with a horizon and the cache on.
    prefetch: Option<Prefetcher>,
    adopt: Vec<Adopted>,
}

impl Streamer {
    pub(crate) fn new(layout: &ExpertLayout) -> Self {
        let n = layout.max_n_expert() as usize;
        Streamer {
            stamp: vec![0; n],
            pos_of: vec![0; n],
            ..Default::default()
        }
    }

    /// Run one MoE layer. On error, every read still in flight is waited for (outcome
    /// ignored) before returning, so no read lands in a slot after the step has given up.
    pub(crate) fn run_layer<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        layer: LayerId,
        routing: &Routing,
    ) -> Result<(), StepError> {
        io.layer_moe = layer.moe;
        let result = self.run_layer_inner(io, layer, routing);
        if result.is_err() {
            for f in self.inflight.iter_mut().filter(|f| !f.delivered) {
                f.delivered = true;
                let _ = io.flash.wait(f.id);
            }
            self.outstanding = 0;
            if let Some(pf) = self.prefetch.as_mut() {
                pf.abort(io.flash);
            }
        }
        result
    }

    fn begin_layer(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.stamp.fill(0);
            self.epoch = 1;
        }
        self.entries.clear();
        self.uses.clear();
        self.misses.clear();
        self.wave.clear();
        self.unpinned = 0;
        self.ready.clear();
        self.inflight.clear();
        self.oldest = 0;
        self.outstanding = 0;
        self.evicted.clear();
        self.lane_cursor = 0;
    }

    /// Add expert `e` to the union if it is not there yet; its position.
    #[inline]
    fn join(&mut self, e: u16) -> usize {
        let ei = e as usize;
        if self.stamp[ei] == self.epoch {
            return self.pos_of[ei] as usize;
        }
        self.stamp[ei] = self.epoch;
        let p = self.entries.len();
        self.pos_of[ei] = p as u32;
        self.entries.push(Entry {
            expert: e,
            slot: SlotId::Staging(p as u16),
            hit: false,
            state: EntryState::Waiting,
            uses_start: 0,
            uses_len: 0,
            fill: 0,
            pending_reads: 0,
            bytes_traced: false,
            spec_touch: false,
            adopted: false,
            bypassed: false,
            access: AccessContext::NONE,
        });
        p
    }

    fn run_layer_inner<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        layer: LayerId,
        routing: &Routing,
    ) -> Result<(), StepError> {
        self.begin_layer();
        let moe = layer.moe;
        let k = routing.k();
        let expert_bytes = io.layout.expert_bytes(moe);

        // Union of the routed experts in first-use order (row-major, rank order within a
        // row): the fixed order serial compute uses.
        for r in 0..routing.n_rows() {
            let ids = routing.ids(r);
            let dropped = routing.dropped(r);
            io.stats.experts_routed += k as u64;
            for rank in 0..k {
                if dropped[rank] {
                    io.stats.experts_dropped += 1;
                    continue;
                }
                let p = self.join(ids[rank]);
                self.entries[p].uses_len += 1;
            }
        }
        let routed_bytes = self.entries.len() as u64 * expert_bytes;
        io.stats.routed_bytes += routed_bytes;
        if let Some(b) = io.stats.layer_routed_bytes.get_mut(moe as usize) {
            *b += routed_bytes;
        }
        if io.config.load_all {
            for e in 0..routing.n_expert() {
                self.join(e as u16);
            }
        }

        // Group the uses by expert (counting sort; rows ascending, so sorted by row, rank).
        let mut total = 0u32;
        for en in &mut self.entries {
            en.uses_start = total;
            total += en.uses_len;
        }
        self.uses.resize(
            total as usize,
            ExpertUse {
                row: 0,
                rank: 0,
                weight: 0.0,
            },
        );
        for r in 0..routing.n_rows() {
            let ids = routing.ids(r);
            let weights = routing.weights(r);
            let dropped = routing.dropped(r);
            for rank in 0..k {
                if dropped[rank] {
                    continue;
                }
                let en = &mut self.entries[self.pos_of[ids[rank] as usize] as usize];
                self.uses[(en.uses_start + en.fill) as usize] = ExpertUse {
                    row: r,
                    rank: rank as u16,
                    weight: weights[rank],
                };
                en.fill += 1;
                en.access.add_use(rank as u16, weights[rank]);
            }
        }

        if io.flash.resident() {
            return self.run_resident(io, layer, routing, expert_bytes);
        }

        let cache_off = io.cache.is_off();
        // Before anything of this layer touches the cache (speculation settles below).
        io.cache.begin_layer(moe);
        if self.prefetch.is_none()
            && (io.config.prefetch > 0 || io.predict.speculates())
            && !cache_off
        {
            self.prefetch = Some(Prefetcher::new(
                io.config.prefetch,
                io.layout.n_moe_layers(),
                io.layout.n_keys(),
            ));
        }
        self.adopt.clear();
        if let Some(pf) = self.prefetch.as_mut() {
            let (stamp, epoch) = (&self.stamp, self.epoch);
            // Everything in the union is looked up (and read if missing), so it is needed.
            let needed = |e: u16| stamp.get(e as usize) == Some(&epoch);
            let decode = io.phase == Phase::Decode;
            pf.begin_layer(io, moe, decode, needed, &mut self.adopt)?;
            pf.record(moe, routing);
        }

        // Lookups: every hit is found and pinned before any miss is admitted.
        let t = io.clock.now();
        for (i, en) in self.entries.iter_mut().enumerate() {
            let key = ExpertKey {
                layer: moe,
                expert: en.expert,
            };
            let lookup = io.cache.lookup_with(key, &en.access)?;
            if cache_off {
                // The entry's place in the union, not its expert id: a decode step then uses
                // only the first k staging slots, so the rest are never committed.
                en.slot = SlotId::Staging(i as u16);
                self.misses.push(i as u32);
            } else {
                en.slot = SlotId::Canonical(key);
                if lookup == Lookup::Hit {
                    en.hit = true;
                    en.state = EntryState::Ready;
                    if let (Some(pf), Some(index)) =
                        (self.prefetch.as_mut(), io.layout.key_index(key))
                    {
                        if pf.touch(index) {
                            en.spec_touch = true;
                            io.stats.spec_useful += 1;
                        }
                    }
                } else {
                    self.misses.push(i as u32);
                }
            }
        }
        // Needed speculative reads still in flight become this layer's own.
        for a in &self.adopt {
            let i = self.pos_of[a.req.tag.expert as usize] as usize;
            let en = &mut self.entries[i];
            en.state = EntryState::Reading;
            en.adopted = true;
            en.pending_reads += 1;
        }
        io.stats.mgmt += io.clock.now() - t;

        if io.sink.wants_routes() {
            self.trace_routes(io, moe, routing, expert_bytes);
        }

        let mut next_miss = 0usize;
        if io.config.overlap {
            self.run_window(io, layer, &mut next_miss, expert_bytes)?;
        } else {
            self.run_waves(io, layer, &mut next_miss, expert_bytes)?;
        }

        io.backend
            .finish_layer(layer)
            .map_err(be(BackendStage::FinishLayer, layer.model))?;
        let t = io.clock.now();
        self.unpin_wave(io, moe)?;
        io.stats.mgmt += io.clock.now() - t;
        Ok(())
    }

    /// Admit the misses from `*next_miss` on, in first-use order, while the cache has room
    /// beside what is pinned (giving up speculation that holds the room first), each joining
    /// `self.wave` as `Reading`. Stops at the first miss that does not fit.
    fn admit_misses<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        layer: LayerId,
        next_miss: &mut usize,
    ) -> Result<(), StepError> {
        let moe = layer.moe;
        let t = io.clock.now();
        if io.cache.is_off() {
            // Nothing is admitted: every miss reads into staging.
            for &i in &self.misses[*next_miss..] {
                self.entries[i as usize].state = EntryState::Reading;
                self.wave.push(i);
            }
            *next_miss = self.misses.len();
            io.stats.mgmt += io.clock.now() - t;
            return Ok(());
        }
        while *next_miss < self.misses.len() {
            let entries = &mut self.entries;
            let mut keys = std::mem::take(&mut self.admit_keys);
            keys.clear();
            keys.extend(self.misses[*next_miss..].iter().map(|&i| {
                let en = &entries[i as usize];
                (
                    ExpertKey {
                        layer: moe,
                        expert: en.expert,
                    },
                    en.access,
                )
            }));
            let (misses, wave, prefetch) = (&self.misses, &mut self.wave, &mut self.prefetch);
            let (backend, layout, from) = (&mut *io.backend, io.layout, *next_miss);
            let mut at = from;
            let n = io.cache.admit_wave(
                keys.iter().copied(),
                &mut self.evicted,
                |key, admission, evicted| {
                    if let (Some(pf), Some(index)) = (prefetch.as_mut(), layout.key_index(key)) {
                        pf.forget(index);
                    }
                    for e in evicted.drain(..) {
                        backend
                            .release(SlotId::Canonical(e))
                            .map_err(be(BackendStage::Release, layer.model))?;
                    }
                    let i = misses[at];
                    let en = &mut entries[i as usize];
                    if admission == Admission::Bypassed {
                        // Not in the cache: the staging slot of its place in the union, which
                        // no other expert of this layer uses and nothing else reads into.
                        en.slot = SlotId::Staging(i as u16);
                        en.bypassed = true;
                    }
                    en.state = EntryState::Reading;
                    wave.push(i);
                    at += 1;
                    Ok::<(), StepError>(())
                },
            );
            self.admit_keys = keys;
            *next_miss = from + n?;
            if *next_miss == self.misses.len() {
                break;
            }
            // No room beside what is pinned. Demand first: give up speculation that holds the
            // room, then retry.
            let abandoned = match self.prefetch.as_mut() {
                Some(pf) => pf.abandon_farthest(io)?,
                None => false,
            };
            if !abandoned {
                break;
            }
        }
        io.stats.mgmt += io.clock.now() - t;
        Ok(())
    }

    /// A miss that fits nowhere even with nothing of this layer left pinned: unreachable while
    /// budget >= layer_demand >= one expert. Refused rather than spun on.
    fn no_room(
        io: &LayerIo<'_, impl Clock, impl Flash, impl Backend>,
        moe: u16,
        expert_bytes: u64,
    ) -> StepError {
        StepError::Cache(crate::cache::CacheError::Corrupt {
            what: format!(
                "MoE layer {moe}: a miss fits nowhere even with nothing pinned (budget {} bytes, expert {} bytes)",
                io.cache.budget_bytes(),
                expert_bytes
            ),
        })
    }

    /// Adopted reads were issued before anything of this layer: they go first in `inflight`.
    fn push_adopted(&mut self) {
        for a in &self.adopt {
            self.inflight.push(InFlight {
                id: a.id,
                req: a.req,
                entry: self.pos_of[a.req.tag.expert as usize],
                delivered: false,
            });
            self.outstanding += 1;
        }
    }

    /// Start a wave (or the window): the first one pins the layer's hits, then as many misses
    /// as fit beside them are admitted, and the first one queues the adopted reads (issued
    /// before anything of this layer). Returns where the wave's misses start in `wave`.
    fn start_wave<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        layer: LayerId,
        next_miss: &mut usize,
        expert_bytes: u64,
        first: bool,
    ) -> Result<usize, StepError> {
        self.wave.clear();
        self.unpinned = 0;
        if first {
            for (i, en) in self.entries.iter().enumerate() {
                if en.hit {
                    self.wave.push(i as u32);
                }
            }
        }
        let misses_start = self.wave.len();
        self.admit_misses(io, layer, next_miss)?;
        if self.wave.is_empty() {
            return Err(Self::no_room(io, layer.moe, expert_bytes));
        }
        self.inflight.clear();
        self.oldest = 0;
        if first {
            self.push_adopted();
        }
        Ok(misses_start)
    }

    /// Serial: admission waves. Each wave pins what it can (the hits and as many misses as fit
    /// beside them), reads all of its misses, then computes; a union wider than the budget
    /// (a wide prefill batch on a small cache) takes more than one wave.
    fn run_waves<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        layer: LayerId,
        next_miss: &mut usize,
        expert_bytes: u64,
    ) -> Result<(), StepError> {
        let moe = layer.moe;
        let mut first_wave = true;
        loop {
            let wave_misses_start =
                self.start_wave(io, layer, next_miss, expert_bytes, first_wave)?;
            let t = io.clock.now();
            self.submit_reads(io, moe, wave_misses_start, 0);
            self.issue_prefetch(io, moe, first_wave)?;
            self.wait_all_in_issue_order(io)?;
            io.stats.io += io.clock.now() - t;
            self.compute_ready_in_order(io, layer)?;
            first_wave = false;
            if *next_miss >= self.misses.len() {
                return Ok(());
            }
            // More misses than fit beside this wave's pins: the wave's experts are computed,
            // so unpin them and admit the rest.
            io.stats.extra_waves += 1;
            let t = io.clock.now();
            self.unpin_wave(io, moe)?;
            io.stats.mgmt += io.clock.now() - t;
        }
    }

    /// Overlap: a sliding window over the layer's union. The hits are pinned and as many
    /// misses admitted as fit beside them; every admitted miss's reads are submitted at once,
    /// across the lanes, and the hits are computed while they land; each missed expert is
    /// computed as soon as its own reads are in. When the union is wider than the budget the
    /// rest does not wait for a whole wave: as soon as the entries at the head of the window
    /// (in admission order) are computed they are unpinned one by one, and after each unpin
    /// the next misses are admitted and their reads submitted. Unpinning in admission order
    /// (never in completion order) makes the sequence of cache operations independent of read
    /// timing, so the cache after the layer is the same on every run and in the simulator.
    fn run_window<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        layer: LayerId,
        next_miss: &mut usize,
        expert_bytes: u64,
    ) -> Result<(), StepError> {
        let moe = layer.moe;
        let misses_start = self.start_wave(io, layer, next_miss, expert_bytes, true)?;
        self.submit_reads(io, moe, misses_start, 0);
        self.issue_prefetch(io, moe, true)?;
        let mut slid = false;

        for i in 0..self.entries.len() {
            if self.entries[i].hit && self.entries[i].state == EntryState::Ready {
                self.compute(io, layer, i)?;
            }
        }
        loop {
            if *next_miss < self.misses.len() {
                // Unpin the computed head of the window, admitting after each unpin.
                while *next_miss < self.misses.len()
                    && self.unpinned < self.wave.len()
                    && self.entries[self.wave[self.unpinned] as usize].state == EntryState::Done
                {
                    let t = io.clock.now();
                    let head = &self.entries[self.wave[self.unpinned] as usize];
                    if !io.cache.is_off() && !head.bypassed {
                        io.cache.unpin(ExpertKey {
                            layer: moe,
                            expert: head.expert,
                        })?;
                    }
                    self.unpinned += 1;
                    let from = self.wave.len();
                    io.stats.mgmt += io.clock.now() - t;
                    self.admit_misses(io, layer, next_miss)?;
                    if self.wave.len() > from {
                        if !slid {
                            slid = true;
                            io.stats.extra_waves += 1;
                        }
                        // Cut as if every lane were busy: a slid-in expert joins lanes that
                        // are busy already, where whole extents read faster. Not the reads
                        // actually in flight: how many are is timing, and the cut (with its
                        // aligned windows, the bytes read) must be the same in the engine and
                        // in the simulator's replay.
                        let queued = io.flash.lanes().max(1) as usize;
                        self.submit_reads(io, moe, from, queued);
                    }
                }
                if *next_miss < self.misses.len() && self.unpinned == self.wave.len() {
                    return Err(Self::no_room(io, moe, expert_bytes));
                }
            }
            while let Some((id, outcome)) = io.flash.poll() {
                self.complete(io, id, outcome)?;
            }
            if let Some(i) = self.ready.pop_front() {
                self.compute(io, layer, i as usize)?;
                continue;
            }
            if self.outstanding == 0 {
                if *next_miss < self.misses.len() {
                    // Nothing in flight and nothing to compute: the loop above unpins and
                    // admits on its next turn, which needs the window's head computed.
                    if self.unpinned < self.wave.len()
                        && self.entries[self.wave[self.unpinned] as usize].state == EntryState::Done
                    {
                        continue;
                    }
                    return Err(Self::no_room(io, moe, expert_bytes));
                }
                break;
            }
            let id = self.inflight[self.oldest].id;
            let t = io.clock.now();
            let outcome = io.flash.wait(id);
            io.stats.stall += io.clock.now() - t;
            self.complete(io, id, outcome)?;
        }
        Ok(())
    }

    /// The resident device (`Flash::resident`): every expert is in memory already, so nothing
    /// is looked up or read. Each expert of the union is computed in first-use order, as a
    /// serial layer computes its experts, and counts as resident (a hit, with no bytes) in
    /// the route trace.
    fn run_resident<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        layer: LayerId,
        routing: &Routing,
        expert_bytes: u64,
    ) -> Result<(), StepError> {
        for (i, en) in self.entries.iter_mut().enumerate() {
            en.slot = SlotId::Staging(i as u16);
            en.hit = true;
            en.state = EntryState::Ready;
        }
        if io.sink.wants_routes() {
            self.trace_routes(io, layer.moe, routing, expert_bytes);
        }
        self.compute_ready_in_order(io, layer)?;
        io.backend
            .finish_layer(layer)
            .map_err(be(BackendStage::FinishLayer, layer.model))
    }

    fn unpin_wave<C, F, B>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        moe: u16,
    ) -> Result<(), StepError> {
        if io.cache.is_off() {
            return Ok(());
        }
        for &i in &self.wave[self.unpinned..] {
            let en = &self.entries[i as usize];
            if en.bypassed {
                continue;
            }
            io.cache.unpin(ExpertKey {
                layer: moe,
                expert: en.expert,
            })?;
        }
        self.unpinned = self.wave.len();
        Ok(())
    }

    fn trace_routes<C, F, B>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        moe: u16,
        routing: &Routing,
        expert_bytes: u64,
    ) {
        let last_row = io.positions.len().saturating_sub(1) as u32;
        for r in 0..routing.n_rows() {
            let ids = routing.ids(r);
            let weights = routing.weights(r);
            let dropped = routing.dropped(r);
            let step = io
                .positions
                .get(routing.batch_row(r) as usize)
                .map_or(-1, |&p| i64::from(p));
            let predicted = io.phase == Phase::Decode && routing.batch_row(r) == last_row;
            for rank in 0..routing.k() {
                let e = ids[rank];
                let (residency, bytes) = if dropped[rank] {
                    // Dropped: the residency it faced, and no bytes (never read).
                    let key = ExpertKey {
                        layer: moe,
                        expert: e,
                    };
                    (u8::from(io.cache.contains(key)), 0)
                } else {
                    let en = &mut self.entries[self.pos_of[e as usize] as usize];
                    if en.hit {
                        if en.spec_touch && !en.bytes_traced {
                            en.bytes_traced = true;
                            (2, 0)
                        } else {
                            (1, 0)
                        }
                    } else if !en.bytes_traced {
                        // Per read, not per routing: only the first routing of a missed
                        // expert in the batch carries its bytes.
                        en.bytes_traced = true;
                        (0, expert_bytes)
                    } else {
                        (0, 0)
                    }
                };
                io.sink.route(&RouteRecord {
                    turn: io.turn,
                    phase: io.phase,
                    step,
                    layer: u32::from(moe),
                    slot: rank as u32,
                    expert: u32::from(e),
                    weight: weights[rank],
                    residency,
                    expert_bytes: bytes,
                    dropped: dropped[rank],
                    preds: if predicted {
                        io.trace_preds.get(rank).copied().unwrap_or_default()
                    } else {
                        Default::default()
                    },
                    row: routing.batch_row(r),
                    router_expert: if predicted {
                        io.router_ids.get(rank).map(|&e| u32::from(e))
                    } else {
                        None
                    },
                });
            }
        }
    }

    /// The reads of every projection extent (cut as `read_split` says) for every entry of
    /// the wave from `from`, lanes round-robin in issue order. `queued`: reads of this layer
    /// still in flight, counted with the new extents when `Auto` decides whether every lane has
    /// one.
    fn submit_reads<C, F: Flash, B>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        moe: u16,
        from: usize,
        queued: usize,
    ) {
        let lanes = io.flash.lanes().max(1);
        let layout = io.layout;
        let Some(layer_layout) = layout.layer(moe) else {
            return;
        };
        let split = io.config.read_split.resolve(
            !io.cache.is_off(),
            io.phase == Phase::Decode,
            self.wave.len().saturating_sub(from) * layer_layout.projections.len() + queued,
            lanes,
        );
        for w in from..self.wave.len() {
            let i = self.wave[w] as usize;
            let (expert, slot) = (self.entries[i].expert, self.entries[i].slot);
            let inflight = &mut self.inflight;
            let mut n = 0u32;
            expert_reads(
                layer_layout,
                moe,
                expert,
                slot,
                split,
                false,
                lanes,
                &mut self.lane_cursor,
                |req| {
                    let id = io.flash.submit(req);
                    inflight.push(InFlight {
                        id,
                        req,
                        entry: i as u32,
                        delivered: false,
                    });
                    n += 1;
                },
            );
            self.outstanding += n as usize;
            self.entries[i].pending_reads += n;
        }
    }

    /// `--prefetch`: after the first wave's demand reads are submitted, resubmit speculative
    /// reads pulled back for them and read ahead the next layers (decode only).
    fn issue_prefetch<C: Clock, F: Flash, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        moe: u16,
        first_wave: bool,
    ) -> Result<(), StepError> {
        if !first_wave {
            return Ok(());
        }
        let Some(pf) = self.prefetch.as_mut() else {
            return Ok(());
        };
        if io.phase == Phase::Decode {
            pf.issue(io, moe, &mut self.lane_cursor)?;
        }
        Ok(())
    }

    /// Account one delivered outcome. A failed or short read of this layer (its own, or a
    /// speculative one it adopted) is an error (sticky, loud); any other speculative outcome
    /// goes to the prefetcher.
    fn complete<C, F, B>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        id: ReadId,
        outcome: Result<ReadDone, FlashError>,
    ) -> Result<(), StepError> {
        let Some(fi) = self.inflight[self.oldest..]
            .iter()
            .position(|f| f.id == id && !f.delivered)
            .map(|p| p + self.oldest)
        else {
            if let Some(pf) = self.prefetch.as_mut() {
                if pf.on_complete(io, id, outcome) {
                    return Ok(());
                }
            }
            return Err(StepError::UnexpectedCompletion { id });
        };
        self.inflight[fi].delivered = true;
        self.outstanding -= 1;
        while self.oldest < self.inflight.len() && self.inflight[self.oldest].delivered {
            self.oldest += 1;
        }
        let f = self.inflight[fi];
        let done = checked(&f.req, id, outcome).map_err(|source| StepError::Flash {
            tag: f.req.tag,
            source,
        })?;
        account_read(io, &f.req, &done);
        let en = &mut self.entries[f.entry as usize];
        en.pending_reads -= 1;
        if en.pending_reads == 0 {
            en.state = EntryState::Ready;
            if en.adopted {
                io.stats.spec_experts += 1;
            }
            self.ready.push_back(f.entry);
        }
        Ok(())
    }

    fn wait_all_in_issue_order<C, F: Flash, B>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
    ) -> Result<(), StepError> {
        for fi in 0..self.inflight.len() {
            if self.inflight[fi].delivered {
                continue;
            }
            let id = self.inflight[fi].id;
            let outcome = io.flash.wait(id);
            self.complete(io, id, outcome)?;
        }
        self.ready.clear();
        Ok(())
    }

    fn compute<C, F, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        layer: LayerId,
        i: usize,
    ) -> Result<(), StepError> {
        let en = self.entries[i];
        if en.uses_len > 0 {
            let uses = &self.uses[en.uses_start as usize..(en.uses_start + en.uses_len) as usize];
            io.backend
                .expert(layer, en.expert, en.slot, uses)
                .map_err(be(BackendStage::Expert, layer.model))?;
        }
        self.entries[i].state = EntryState::Done;
        Ok(())
    }

    /// Serial: every expert whose bytes are in, in the fixed first-use order.
    fn compute_ready_in_order<C, F, B: Backend>(
        &mut self,
        io: &mut LayerIo<'_, C, F, B>,
        layer: LayerId,
    ) -> Result<(), StepError> {
        for i in 0..self.entries.len() {
            if self.entries[i].state == EntryState::Ready {
                self.compute(io, layer, i)?;
            }
        }
        Ok(())
    }
}
