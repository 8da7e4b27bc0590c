//! Test doubles for the three leaves, shared by the core's, the engine's, the simulator's and
//! the gates' tests: a clock you advance by hand, an in-memory flash device with a simple lane
//! timing model, a fault-injecting wrapper (after TigerBeetle's testing storage and redb's
//! `StorageBackend`), and a scripted backend that checks every expert's bytes.
//!
//! Everything here is deterministic: no ambient time, no unseeded randomness, no dependence
//! on `HashMap` iteration order.

use crate::backend::{Backend, ExpertUse, LayerId, Prediction, Routing, RoutingError, SlotId};
use crate::clock::{Clock, Nanos};
use crate::flash::{Flash, FlashError, ReadDone, ReadId, ReadRequest};
use crate::layout::{ExpertKey, ExpertLayout, LayoutError, MoeLayerLayout, ProjExtent};
use crate::records::{IoRecord, RecordSink, RouteRecord};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use thiserror::Error;

/// The fault-injecting device and the mixer live in `faults` (production code uses them);
/// re-exported here, where tests have always found them.
pub use crate::faults::{splitmix64, Fault, FaultyFlash};

/// A clock that moves only when told to. Clones share the same time, so a test hands one
/// clone to the flash device, one to the backend and one to the engine.
#[derive(Clone, Debug, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock at time 0.
    pub fn new() -> Self {
        Self::default()
    }
    /// Move forward by `d`.
    pub fn advance(&self, d: Nanos) {
        self.0.fetch_add(d.0, Ordering::SeqCst);
    }
    /// Move forward to `t` (never backwards).
    pub fn advance_to(&self, t: Nanos) {
        self.0.fetch_max(t.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        Nanos(self.0.load(Ordering::SeqCst))
    }
}

/// Memory behind slots, for tests: `(slot, projection) -> bytes`. `MemFlash` writes a read's
/// bytes here when its completion is delivered; `ScriptBackend` reads them when it computes and
/// forgets them on `release`. Clones share the same memory.
#[derive(Clone, Debug, Default)]
pub struct SlotStore(Arc<Mutex<SlotBytes>>);

/// `(slot, projection) -> bytes`.
type SlotBytes = HashMap<(SlotId, u8), Vec<u8>>;

/// Shard contents: one byte vector per shard file.
pub type Shards = Arc<Vec<Vec<u8>>>;

impl SlotStore {
    /// Empty memory.
    pub fn new() -> Self {
        Self::default()
    }
    fn lock(&self) -> MutexGuard<'_, SlotBytes> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Write `bytes` at `offset` of projection `proj` of `slot`, growing it as needed.
    pub fn write(&self, slot: SlotId, proj: u8, offset: u64, bytes: &[u8]) {
        let mut m = self.lock();
        let v = m.entry((slot, proj)).or_default();
        let end = offset as usize + bytes.len();
        if v.len() < end {
            v.resize(end, 0);
        }
        v[offset as usize..end].copy_from_slice(bytes);
    }
    /// Whether projection `proj` of `slot` holds exactly `expected`.
    pub fn holds(&self, slot: SlotId, proj: u8, expected: &[u8]) -> bool {
        self.lock()
            .get(&(slot, proj))
            .is_some_and(|v| v.as_slice() == expected)
    }
    /// Forget every projection of `slot`.
    pub fn clear_slot(&self, slot: SlotId) {
        self.lock().retain(|(s, _), _| *s != slot);
    }
    /// Number of (slot, projection) buffers held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }
    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A sink that keeps every record (both kinds wanted).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RecordingSink {
    pub routes: Vec<RouteRecord>,
    pub ios: Vec<IoRecord>,
}

impl RecordSink for RecordingSink {
    fn wants_routes(&self) -> bool {
        true
    }
    fn wants_io(&self) -> bool {
        true
    }
    fn route(&mut self, r: &RouteRecord) {
        self.routes.push(r.clone());
    }
    fn io(&mut self, r: &IoRecord) {
        self.ios.push(r.clone());
    }
}

/// How `MemFlash` times reads.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MemTiming {
    /// Fixed time per read.
    pub latency: Nanos,
    /// Bytes per microsecond per lane; 0 = no transfer time.
    pub bytes_per_us: u64,
    /// O_DIRECT-style alignment of the window actually read (`read_bytes`); 0 or 1 = none.
    pub align_bytes: u64,
}

#[derive(Clone, Debug)]
struct Pending {
    id: ReadId,
    req: ReadRequest,
    submit: Nanos,
    start: Nanos,
    end: Nanos,
}

/// An in-memory flash device: serves reads from one byte vector per shard.
///
/// Timing: each lane is a FIFO; a read starts at `max(submit time, lane free)` and ends
/// `latency + len / bandwidth` later. `wait` advances the shared `ManualClock` to the read's
/// end (as the simulator would); `poll` delivers the earliest read whose end is not after
/// now. With the default timing every read completes instantly. Bytes are copied into the
/// `SlotStore` only when a completion is delivered, so computing on a slot before waiting is
/// caught by `ScriptBackend`. Every request is logged. `cancel` removes a read that has not
/// started (the lane time it reserved is not given back).
#[derive(Debug)]
pub struct MemFlash {
    shards: Arc<Vec<Vec<u8>>>,
    lanes: u32,
    clock: ManualClock,
    timing: MemTiming,
    store: Option<SlotStore>,
    next_id: u64,
    lane_free: Vec<Nanos>,
    pending: Vec<Pending>,
    log: Vec<ReadRequest>,
    cancelled: u64,
}

impl MemFlash {
    /// A device over `shards` with `lanes` lanes (at least 1), timed on `clock`.
    pub fn new(shards: Arc<Vec<Vec<u8>>>, lanes: u32, clock: ManualClock) -> Self {
        let lanes = lanes.max(1);
        MemFlash {
            shards,
            lanes,
            clock,
            timing: MemTiming::default(),
            store: None,
            next_id: 0,
            lane_free: vec![Nanos::ZERO; lanes as usize],
            pending: Vec::new(),
            log: Vec::new(),
            cancelled: 0,
        }
    }
    /// Set the timing model.
    pub fn with_timing(mut self, timing: MemTiming) -> Self {
        self.timing = timing;
        self
    }
    /// Deliver bytes into `store`.
    pub fn with_store(mut self, store: SlotStore) -> Self {
        self.store = Some(store);
        self
    }
    /// Every request submitted so far, in order.
    pub fn log(&self) -> &[ReadRequest] {
        &self.log
    }
    /// Forget the request log.
    pub fn clear_log(&mut self) {
        self.log.clear();
    }
    /// Reads submitted and not yet delivered.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
    /// Reads cancelled.
    pub fn cancelled(&self) -> u64 {
        self.cancelled
    }

    fn outcome(&self, p: &Pending) -> Result<ReadDone, FlashError> {
        let r = &p.req;
        if r.lane >= self.lanes {
            return Err(FlashError::BadLane {
                id: p.id,
                lane: r.lane,
                lanes: self.lanes,
            });
        }
        let shard = self.shards.get(r.shard as usize);
        let end = r.offset.checked_add(r.len);
        let in_range = matches!((shard, end), (Some(s), Some(e)) if e <= s.len() as u64);
        if !in_range {
            return Err(FlashError::Io {
                shard: r.shard,
                offset: r.offset,
                len: r.len,
                message: "read past the end of the shard".into(),
            });
        }
        let a = self.timing.align_bytes.max(1);
        let lo = r.offset / a * a;
        let hi = (r.offset + r.len).div_ceil(a) * a;
        Ok(ReadDone {
            id: p.id,
            lane: r.lane,
            req_bytes: r.len,
            read_bytes: hi - lo,
            submit: p.submit,
            start: p.start,
            end: p.end,
        })
    }

    fn deliver(&mut self, index: usize) -> (ReadId, Result<ReadDone, FlashError>) {
        let p = self.pending.remove(index);
        let outcome = self.outcome(&p);
        if outcome.is_ok() {
            if let Some(store) = &self.store {
                let r = &p.req;
                let s = &self.shards[r.shard as usize];
                store.write(
                    r.dest,
                    r.tag.proj,
                    r.dest_offset,
                    &s[r.offset as usize..(r.offset + r.len) as usize],
                );
            }
        }
        (p.id, outcome)
    }
}

impl Flash for MemFlash {
    fn lanes(&self) -> u32 {
        self.lanes
    }

    fn submit(&mut self, read: ReadRequest) -> ReadId {
        let id = ReadId(self.next_id);
        self.next_id += 1;
        self.log.push(read);
        let now = self.clock.now();
        let lane = (read.lane as usize).min(self.lane_free.len() - 1);
        let start = now.max(self.lane_free[lane]);
        let transfer = match self.timing.bytes_per_us {
            0 => Nanos::ZERO,
            b => Nanos(read.len.saturating_mul(1_000) / b),
        };
        let end = start + self.timing.latency + transfer;
        if read.lane < self.lanes {
            self.lane_free[lane] = end;
        }
        self.pending.push(Pending {
            id,
            req: read,
            submit: now,
            start,
            end,
        });
        id
    }

    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        let Some(i) = self.pending.iter().position(|p| p.id == id) else {
            return Err(FlashError::UnknownRead { id });
        };
        self.clock.advance_to(self.pending[i].end);
        self.deliver(i).1
    }

    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        let now = self.clock.now();
        let i = self
            .pending
            .iter()
            .enumerate()
            .filter(|(_, p)| p.end <= now)
            .min_by_key(|(_, p)| (p.end, p.id))
            .map(|(i, _)| i)?;
        Some(self.deliver(i))
    }

    fn cancel(&mut self, id: ReadId) -> bool {
        let now = self.clock.now();
        match self.pending.iter().position(|p| p.id == id) {
            Some(i) if self.pending[i].start > now => {
                self.pending.remove(i);
                self.cancelled += 1;
                true
            }
            _ => false,
        }
    }
}

/// A synthetic model's expert layout and flash contents: `n_model_layers` layers, the ones in
/// `moe_layers` with `n_expert` experts whose projections have the given strides, all in shard
/// 0 after a small header, filled with seeded pseudo-random bytes (distinct per expert).
pub fn synthetic_model(
    n_model_layers: u32,
    moe_layers: &[u32],
    n_expert: u32,
    n_expert_used: u16,
    proj_bytes: &[u64],
    seed: u64,
) -> Result<(ExpertLayout, Shards), LayoutError> {
    let mut offset = 4096u64;
    let mut layers = Vec::new();
    for &m in moe_layers {
        let projections = proj_bytes
            .iter()
            .map(|&s| {
                let p = ProjExtent {
                    shard: 0,
                    base_offset: offset,
                    stride_bytes: s,
                };
                offset += s * u64::from(n_expert);
                p
            })
            .collect();
        layers.push(MoeLayerLayout {
            model_layer: m,
            n_expert,
            projections,
            dense_bytes: 1000,
        });
    }
    let layout = ExpertLayout::new(n_model_layers, layers, n_expert_used)?;
    let mut bytes = vec![0u8; offset as usize];
    let mut s = seed;
    for b in bytes.iter_mut() {
        s = splitmix64(s);
        *b = (s >> 56) as u8;
    }
    Ok((layout, Arc::new(vec![bytes])))
}

/// FNV-1a over bytes: a slot's content in one number.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// One call the scripted backend received.
#[derive(Clone, Debug, PartialEq)]
pub enum Call {
    Begin {
        tokens: Vec<u32>,
        positions: Vec<u32>,
    },
    Dense {
        layer: u32,
    },
    Route {
        layer: LayerId,
    },
    Expert {
        layer: LayerId,
        expert: u16,
        slot: SlotId,
        uses: Vec<ExpertUse>,
        /// FNV-1a of each projection's bytes in the slot (empty without a store).
        digests: Vec<u64>,
    },
    FinishLayer {
        layer: LayerId,
    },
    Head,
    Release {
        slot: SlotId,
    },
}

/// Why the scripted backend refused a call: each is a broken core contract.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ScriptError {
    #[error("expert {expert} of MoE layer {layer} projection {proj}: slot {slot:?} does not hold its bytes")]
    WrongBytes {
        layer: u16,
        expert: u16,
        proj: u8,
        slot: SlotId,
    },
    #[error("expert {expert} of MoE layer {layer} computed twice in one step")]
    ComputedTwice { layer: u16, expert: u16 },
    #[error("expert {expert} of MoE layer {layer} got a use (row {row}, rank {rank}) the routing does not contain")]
    BadUse {
        layer: u16,
        expert: u16,
        row: u32,
        rank: u16,
    },
    #[error("call out of order: {what}")]
    Order { what: String },
    #[error("routing: {0}")]
    Routing(#[from] RoutingError),
    #[error("injected failure in {what}")]
    Injected { what: &'static str },
}

/// Time the scripted backend charges to its clock per call.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ScriptCosts {
    pub dense: Nanos,
    pub route: Nanos,
    pub expert: Nanos,
    pub finish_layer: Nanos,
    pub head: Nanos,
    pub release: Nanos,
}

/// Routing function: `(layer, position, k, n_expert) -> k distinct expert ids, rank order`.
pub type RouteFn = Box<dyn FnMut(LayerId, u32, usize, u32) -> Vec<u16> + Send>;

/// Scripted prediction: `(from, target, position of the last row, k, n_expert) -> the
/// predicted ids in rank order`, or `None` for no prediction.
pub type PredictFn = Box<dyn FnMut(LayerId, LayerId, u32, usize, u32) -> Option<Vec<u16>> + Send>;

/// A deterministic backend for tests: routes by a seeded skewed draw (or a supplied
/// function), checks that every expert it computes sees exactly its bytes from the shards,
/// that each routed expert is computed once per layer with the uses the routing implies, and
/// folds a stand-in "hidden state" per row from the slot digests, summed in rank order at
/// `finish_layer` — so serial and overlap runs must end in identical `state()`.
pub struct ScriptBackend {
    layout: ExpertLayout,
    shards: Arc<Vec<Vec<u8>>>,
    store: Option<SlotStore>,
    clock: ManualClock,
    costs: ScriptCosts,
    route_fn: RouteFn,
    predict_fn: Option<PredictFn>,
    /// Per `predict` call: (from, target).
    pub predictions: Vec<(LayerId, LayerId)>,
    k: usize,
    /// Route only the last batch row at the last MoE layer (llama.cpp's prefill gather).
    pub last_layer_last_row_only: bool,
    log: Vec<Call>,
    positions: Vec<u32>,
    // Per MoE layer being computed: the routing and per-(row, rank) outputs.
    routing: Routing,
    outputs: Vec<Option<u64>>,
    state: Vec<u64>,
    fail_expert_call: Option<u64>,
    expert_calls: u64,
    /// A stand-in KV: per context position, the folded state its row ended a step with.
    kv: Vec<u64>,
    /// `keep_prefix`'s copy of `kv[..n]`.
    kept: Option<Vec<u64>>,
    /// The last row's stand-in logits (`SCRIPT_VOCAB` wide), a function of the whole context.
    logits: Vec<f32>,
}

/// The width of the scripted backend's logits. Its last token is never possible (−∞).
pub const SCRIPT_VOCAB: usize = 16;

impl ScriptBackend {
    /// A backend over `layout` / `shards` routing `k` experts per row by a seeded draw that
    /// favours low expert ids (so a cache sees reuse), charging `costs` to `clock`.
    pub fn new(
        layout: ExpertLayout,
        shards: Arc<Vec<Vec<u8>>>,
        k: usize,
        seed: u64,
        clock: ManualClock,
        costs: ScriptCosts,
    ) -> Self {
        let route_fn: RouteFn = Box::new(move |layer, pos, k, n_expert| {
            let mut s = splitmix64(seed ^ (u64::from(layer.moe) << 40) ^ u64::from(pos));
            let mut out: Vec<u16> = Vec::with_capacity(k);
            let k = k.min(n_expert as usize);
            while out.len() < k {
                s = splitmix64(s);
                // Squaring a uniform draw skews towards low ids.
                let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                let e = ((u * u) * f64::from(n_expert)) as u16;
                if !out.contains(&e) {
                    out.push(e);
                }
            }
            out
        });
        ScriptBackend {
            layout,
            shards,
            store: None,
            clock,
            costs,
            route_fn,
            predict_fn: None,
            predictions: Vec::new(),
            k,
            last_layer_last_row_only: false,
            log: Vec::new(),
            positions: Vec::new(),
            routing: Routing::new(),
            outputs: Vec::new(),
            state: Vec::new(),
            fail_expert_call: None,
            expert_calls: 0,
            kv: Vec::new(),
            kept: None,
            logits: Vec::new(),
        }
    }
    /// Check slot bytes against `store` (which the flash device must fill).
    pub fn with_store(mut self, store: SlotStore) -> Self {
        self.store = Some(store);
        self
    }
    /// Route with `f` instead of the seeded draw.
    pub fn with_routes(mut self, f: RouteFn) -> Self {
        self.route_fn = f;
        self
    }
    /// Answer `Backend::predict` with `f` (weights: the same descending shape `route` gives).
    /// Without it the backend predicts nothing (the trait's default).
    pub fn with_predict(mut self, f: PredictFn) -> Self {
        self.predict_fn = Some(f);
        self
    }
    /// Fail the `n`-th `expert` call (0-based, counted over the backend's life).
    pub fn fail_expert_call(mut self, n: u64) -> Self {
        self.fail_expert_call = Some(n);
        self
    }
    /// Every call so far.
    pub fn log(&self) -> &[Call] {
        &self.log
    }
    /// Forget the call log.
    pub fn clear_log(&mut self) {
        self.log.clear();
    }
    /// Per batch row of the last step: the folded stand-in hidden state.
    pub fn state(&self) -> &[u64] {
        &self.state
    }

    fn slot_digests(&self, layer: u16, expert: u16, slot: SlotId) -> Result<Vec<u64>, ScriptError> {
        let Some(store) = &self.store else {
            return Ok(Vec::new());
        };
        let n_proj = self.layout.layer(layer).map_or(0, |l| l.projections.len());
        let key = ExpertKey { layer, expert };
        let mut digests = Vec::with_capacity(n_proj);
        for proj in 0..n_proj as u8 {
            let expected = self
                .layout
                .extent(key, proj)
                .and_then(|(shard, off, len)| {
                    self.shards
                        .get(shard as usize)
                        .and_then(|s| s.get(off as usize..(off + len) as usize))
                })
                .unwrap_or(&[]);
            if !store.holds(slot, proj, expected) {
                return Err(ScriptError::WrongBytes {
                    layer,
                    expert,
                    proj,
                    slot,
                });
            }
            digests.push(fnv1a(expected));
        }
        Ok(digests)
    }
}

impl Backend for ScriptBackend {
    type Error = ScriptError;

    fn begin(&mut self, tokens: &[u32], positions: &[u32]) -> Result<(), ScriptError> {
        self.positions = positions.to_vec();
        self.state = tokens.iter().map(|&t| splitmix64(u64::from(t))).collect();
        self.log.push(Call::Begin {
            tokens: tokens.to_vec(),
            positions: positions.to_vec(),
        });
        Ok(())
    }

    fn dense(&mut self, layer: u32) -> Result<(), ScriptError> {
        self.clock.advance(self.costs.dense);
        self.log.push(Call::Dense { layer });
        Ok(())
    }

    fn route(&mut self, layer: LayerId, routing: &mut Routing) -> Result<(), ScriptError> {
        self.clock.advance(self.costs.route);
        let n = self.positions.len() as u32;
        let last_moe = self.layout.n_moe_layers().saturating_sub(1);
        let rows = if self.last_layer_last_row_only && layer.moe == last_moe {
            n.saturating_sub(1)..n
        } else {
            0..n
        };
        self.routing.reset(routing.n_expert(), n);
        for b in rows {
            let pos = self.positions[b as usize];
            let ids = (self.route_fn)(layer, pos, self.k, routing.n_expert());
            // Descending weights that sum to 1, deterministic per (ids).
            let raw: Vec<f32> = (0..ids.len()).map(|j| 1.0 / (j as f32 + 1.5)).collect();
            let sum: f32 = raw.iter().sum();
            let weights: Vec<f32> = raw.iter().map(|w| w / sum).collect();
            routing.push_row(b, &ids, &weights)?;
            self.routing.push_row(b, &ids, &weights)?;
        }
        self.outputs.clear();
        self.outputs
            .resize(self.routing.n_rows() as usize * self.routing.k(), None);
        self.log.push(Call::Route { layer });
        Ok(())
    }

    fn expert(
        &mut self,
        layer: LayerId,
        expert: u16,
        slot: SlotId,
        uses: &[ExpertUse],
    ) -> Result<(), ScriptError> {
        self.clock.advance(self.costs.expert);
        let call = self.expert_calls;
        self.expert_calls += 1;
        if self.fail_expert_call == Some(call) {
            return Err(ScriptError::Injected { what: "expert" });
        }
        let digests = self.slot_digests(layer.moe, expert, slot)?;
        let content = digests
            .iter()
            .fold(u64::from(expert), |h, &d| splitmix64(h ^ d));
        let k = self.routing.k();
        for u in uses {
            let i = u.row as usize * k + u.rank as usize;
            let routed = u.row < self.routing.n_rows()
                && (u.rank as usize) < k
                && self.routing.ids(u.row)[u.rank as usize] == expert;
            match self.outputs.get_mut(i).filter(|_| routed) {
                Some(o @ None) => *o = Some(splitmix64(content ^ u64::from(u.weight.to_bits()))),
                Some(Some(_)) => {
                    return Err(ScriptError::ComputedTwice {
                        layer: layer.moe,
                        expert,
                    })
                }
                None => {
                    return Err(ScriptError::BadUse {
                        layer: layer.moe,
                        expert,
                        row: u.row,
                        rank: u.rank,
                    })
                }
            }
        }
        self.log.push(Call::Expert {
            layer,
            expert,
            slot,
            uses: uses.to_vec(),
            digests,
        });
        Ok(())
    }

    fn finish_layer(&mut self, layer: LayerId) -> Result<(), ScriptError> {
        self.clock.advance(self.costs.finish_layer);
        // The routing here is the router's, before any hook: ranks a hook truncated or
        // dropped have no output and contribute nothing, like the zeroed per-rank buffers of
        // a real backend. Completeness is checked by the tests against the call log.
        let k = self.routing.k();
        for r in 0..self.routing.n_rows() {
            let b = self.routing.batch_row(r) as usize;
            for rank in 0..k {
                let Some(out) = self.outputs[r as usize * k + rank] else {
                    continue;
                };
                // Rank order: a non-commutative fold, so any reordering would show.
                if let Some(s) = self.state.get_mut(b) {
                    *s = splitmix64(s.rotate_left(7) ^ out);
                }
            }
        }
        self.outputs.fill(None);
        self.log.push(Call::FinishLayer { layer });
        Ok(())
    }

    fn head(&mut self) -> Result<(), ScriptError> {
        self.clock.advance(self.costs.head);
        // Every row's final state is its position's KV entry; the last row's logits fold the
        // whole context up to it, so a wrong restored prefix shows in them.
        for (&pos, &s) in self.positions.iter().zip(&self.state) {
            let p = pos as usize;
            if self.kv.len() <= p {
                self.kv.resize(p + 1, 0);
            }
            self.kv[p] = s;
        }
        let last = self.positions.last().map_or(0, |&p| p as usize + 1);
        let ctx = self.kv[..last.min(self.kv.len())]
            .iter()
            .fold(0x5eed_u64, |h, &s| splitmix64(h.rotate_left(5) ^ s));
        self.logits = (0..SCRIPT_VOCAB as u64)
            .map(|v| {
                if v + 1 == SCRIPT_VOCAB as u64 {
                    f32::NEG_INFINITY
                } else {
                    (splitmix64(ctx ^ v) >> 40) as f32 / (1u64 << 24) as f32 * 8.0 - 4.0
                }
            })
            .collect();
        self.log.push(Call::Head);
        Ok(())
    }

    fn last_logits(&self) -> Option<&[f32]> {
        (!self.logits.is_empty()).then_some(&self.logits[..])
    }

    fn keep_prefix(&mut self, n: u32) -> Result<Option<u64>, ScriptError> {
        let n = n as usize;
        if n > self.kv.len() {
            return Err(ScriptError::Order {
                what: format!(
                    "keep_prefix({n}) but only {} positions were fed",
                    self.kv.len()
                ),
            });
        }
        let kept = self.kv[..n].to_vec();
        let bytes = (kept.len() * 8) as u64;
        self.kept = Some(kept);
        Ok(Some(bytes))
    }

    fn restore_prefix(&mut self) -> Result<Option<u32>, ScriptError> {
        let Some(k) = &self.kept else {
            return Ok(None);
        };
        if self.kv.len() < k.len() {
            self.kv.resize(k.len(), 0);
        }
        self.kv[..k.len()].copy_from_slice(k);
        Ok(Some(k.len() as u32))
    }

    fn drop_prefix(&mut self) {
        self.kept = None;
    }

    fn predict(
        &mut self,
        from: LayerId,
        target: LayerId,
        k: usize,
        out: &mut Prediction,
    ) -> Result<bool, ScriptError> {
        out.clear();
        let Some(f) = self.predict_fn.as_mut() else {
            return Ok(false);
        };
        self.predictions.push((from, target));
        let n_expert = self.layout.layer(target.moe).map_or(0, |l| l.n_expert);
        let pos = self.positions.last().copied().unwrap_or(0);
        let Some(ids) = f(from, target, pos, k, n_expert) else {
            return Ok(false);
        };
        let raw: Vec<f32> = (0..ids.len()).map(|j| 1.0 / (j as f32 + 1.5)).collect();
        let sum: f32 = raw.iter().sum();
        out.weights.extend(raw.iter().map(|w| w / sum));
        out.ids.extend_from_slice(&ids);
        Ok(true)
    }

    fn release(&mut self, slot: SlotId) -> Result<(), ScriptError> {
        self.clock.advance(self.costs.release);
        if let Some(store) = &self.store {
            store.clear_slot(slot);
        }
        self.log.push(Call::Release { slot });
        Ok(())
    }
}

/// A plain read of `len` bytes at `offset` of shard 0 on `lane`, into expert (0, 0)'s canonical
/// slot: what device tests submit when only the extent and the lane matter.
pub fn read_request(lane: u32, offset: u64, len: u64) -> ReadRequest {
    ReadRequest {
        shard: 0,
        offset,
        len,
        dest: crate::backend::SlotId::Canonical(crate::layout::ExpertKey {
            layer: 0,
            expert: 0,
        }),
        dest_offset: 0,
        lane,
        speculative: false,
        tag: crate::flash::ReadTag {
            layer: 0,
            expert: 0,
            proj: 0,
        },
    }
}
