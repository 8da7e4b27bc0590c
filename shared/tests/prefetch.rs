//! Tests of `--prefetch K` (previous-token speculative prefetch) through the decode step, over
//! the in-memory flash and the scripted backend: the output never changes, the budget and the
//! pins hold, a slot is never released under a landing read, every demand miss is read exactly
//! once, unneeded speculation is cancelled, a failed unneeded read is not fatal (a needed one
//! is), and the whole thing is deterministic.

use bmoe_core::backend::{Backend, ExpertUse, LayerId, Routing, SlotId};
use bmoe_core::cache::ExpertCache;
use bmoe_core::clock::Nanos;
use bmoe_core::flash::{Flash, FlashError, ReadDone, ReadId, ReadRequest};
use bmoe_core::layout::ExpertLayout;
use bmoe_core::policy::Lru;
use bmoe_core::records::{Phase, RecordSink};
use bmoe_core::step::{Engine, StepError, StepInput, StepStats, StreamConfig};
use bmoe_core::testing::{
    synthetic_model, Fault, FaultyFlash, ManualClock, MemFlash, MemTiming, RecordingSink, RouteFn,
    ScriptBackend, ScriptCosts, ScriptError, SlotStore,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

const N_LAYERS: u32 = 4;
const N_EXPERT: u32 = 16;
const K: u16 = 4;
const PROJ: [u64; 3] = [24, 24, 40];

/// Slots with a read submitted and not yet delivered or cancelled, shared between the two
/// wrappers below, plus every violation seen.
#[derive(Default)]
struct Watch {
    in_flight: HashMap<u64, SlotId>,
    violations: Vec<String>,
}

type Shared = Arc<Mutex<Watch>>;

fn lock(w: &Shared) -> std::sync::MutexGuard<'_, Watch> {
    w.lock().unwrap_or_else(|e| e.into_inner())
}

/// A flash wrapper that tracks which slots have a read in flight.
struct Watched<F> {
    inner: F,
    watch: Shared,
}

impl<F: Flash> Flash for Watched<F> {
    fn lanes(&self) -> u32 {
        self.inner.lanes()
    }
    fn submit(&mut self, read: ReadRequest) -> ReadId {
        let id = self.inner.submit(read);
        lock(&self.watch).in_flight.insert(id.0, read.dest);
        id
    }
    fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
        lock(&self.watch).in_flight.remove(&id.0);
        self.inner.wait(id)
    }
    fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
        let r = self.inner.poll()?;
        lock(&self.watch).in_flight.remove(&r.0 .0);
        Some(r)
    }
    fn cancel(&mut self, id: ReadId) -> bool {
        let ok = self.inner.cancel(id);
        if ok {
            lock(&self.watch).in_flight.remove(&id.0);
        }
        ok
    }
}

/// A backend wrapper that refuses (records) a release or a compute on a slot with a read in
/// flight.
struct Guarded {
    inner: ScriptBackend,
    watch: Shared,
}

impl Guarded {
    fn check(&self, what: &str, slot: SlotId) {
        let mut w = lock(&self.watch);
        if w.in_flight.values().any(|&s| s == slot) {
            w.violations
                .push(format!("{what} of {slot:?} with a read in flight"));
        }
    }
}

impl Backend for Guarded {
    type Error = ScriptError;
    fn begin(&mut self, tokens: &[u32], positions: &[u32]) -> Result<(), ScriptError> {
        self.inner.begin(tokens, positions)
    }
    fn dense(&mut self, layer: u32) -> Result<(), ScriptError> {
        self.inner.dense(layer)
    }
    fn route(&mut self, layer: LayerId, routing: &mut Routing) -> Result<(), ScriptError> {
        self.inner.route(layer, routing)
    }
    fn expert(
        &mut self,
        layer: LayerId,
        expert: u16,
        slot: SlotId,
        uses: &[ExpertUse],
    ) -> Result<(), ScriptError> {
        self.check("compute", slot);
        self.inner.expert(layer, expert, slot, uses)
    }
    fn finish_layer(&mut self, layer: LayerId) -> Result<(), ScriptError> {
        self.inner.finish_layer(layer)
    }
    fn head(&mut self) -> Result<(), ScriptError> {
        self.inner.head()
    }
    fn release(&mut self, slot: SlotId) -> Result<(), ScriptError> {
        self.check("release", slot);
        self.inner.release(slot)
    }
}

#[derive(Copy, Clone)]
enum Routes {
    /// The scripted backend's seeded skewed draw (some token-to-token reuse).
    Seeded,
    /// Every token routes the same experts at a layer (perfect previous-token prediction).
    Repeat,
    /// Every token routes experts disjoint from the previous token's (prediction always wrong).
    Rotate,
}

#[derive(Copy, Clone)]
struct Case {
    prefetch: u32,
    overlap: bool,
    budget_experts: u64,
    routes: Routes,
    lanes: u32,
    latency_ns: u64,
    expert_ns: u64,
    fault: Option<u64>,
    seed: u64,
    max_read_bytes: u64,
}

impl Default for Case {
    fn default() -> Self {
        Case {
            prefetch: 0,
            overlap: false,
            budget_experts: 10,
            routes: Routes::Seeded,
            lanes: 2,
            latency_ns: 2_000,
            expert_ns: 1_500,
            fault: None,
            seed: 5,
            max_read_bytes: 0,
        }
    }
}

type Rig = Engine<ManualClock, Watched<FaultyFlash<MemFlash>>, Guarded>;

fn rig(c: &Case) -> (Rig, ExpertLayout, Shared) {
    let layers: Vec<u32> = (0..N_LAYERS).collect();
    let (layout, shards) = synthetic_model(N_LAYERS, &layers, N_EXPERT, K, &PROJ, 11).unwrap();
    let clock = ManualClock::new();
    let store = SlotStore::new();
    let flash = MemFlash::new(shards.clone(), c.lanes, clock.clone())
        .with_timing(MemTiming {
            latency: Nanos(c.latency_ns),
            bytes_per_us: 8,
            align_bytes: 16,
        })
        .with_store(store.clone());
    let costs = ScriptCosts {
        dense: Nanos(1_000),
        expert: Nanos(c.expert_ns),
        ..Default::default()
    };
    let mut backend = ScriptBackend::new(
        layout.clone(),
        shards,
        K as usize,
        c.seed,
        clock.clone(),
        costs,
    )
    .with_store(store);
    let route: Option<RouteFn> = match c.routes {
        Routes::Seeded => None,
        Routes::Repeat => Some(Box::new(|layer, _pos, k, n| {
            (0..k as u16)
                .map(|j| (layer.moe * 3 + j * 2) % n as u16)
                .collect()
        })),
        Routes::Rotate => Some(Box::new(|_layer, pos, k, n| {
            (0..k as u16)
                .map(|j| ((pos as u16 % 4) * k as u16 + j) % n as u16)
                .collect()
        })),
    };
    if let Some(f) = route {
        backend = backend.with_routes(f);
    }
    backend.last_layer_last_row_only = true;
    let budget = c.budget_experts * layout.max_expert_bytes();
    let cache = ExpertCache::new(&layout, budget, K, Box::new(Lru::new())).unwrap();
    let watch = Shared::default();
    let flash = Watched {
        inner: FaultyFlash::new(flash, c.fault.unwrap_or(u64::MAX), Fault::Eio),
        watch: watch.clone(),
    };
    let backend = Guarded {
        inner: backend,
        watch: watch.clone(),
    };
    let config = StreamConfig {
        overlap: c.overlap,
        prefetch: c.prefetch,
        read_split: if c.max_read_bytes == 0 {
            bmoe_core::ReadSplit::Whole
        } else {
            bmoe_core::ReadSplit::MaxBytes(c.max_read_bytes)
        },
        ..Default::default()
    };
    let e = Engine::new(clock, flash, backend, layout.clone(), cache, config).unwrap();
    (e, layout, watch)
}

/// What a run produced and did, step by step.
#[derive(Debug, PartialEq)]
struct Ran {
    /// Per step: the backend's folded hidden state (the "output").
    states: Vec<Vec<u64>>,
    stats: Vec<StepStats>,
    /// Per step: the requests submitted.
    requests: Vec<Vec<ReadRequest>>,
    routes: Vec<(i64, u32, u32, u8)>,
}

fn run(c: &Case, n_decode: u32) -> Result<Ran, StepError> {
    let (mut e, _layout, watch) = rig(c);
    let mut sink = RecordingSink::default();
    let mut ran = Ran {
        states: Vec::new(),
        stats: Vec::new(),
        requests: Vec::new(),
        routes: Vec::new(),
    };
    let budget = e.cache().budget_bytes();
    let n_prompt = 5u32;
    for t in 0..=n_decode {
        let (tokens, positions, phase): (Vec<u32>, Vec<u32>, Phase) = if t == 0 {
            (
                (0..n_prompt).map(|i| 100 + i).collect(),
                (0..n_prompt).collect(),
                Phase::Prefill,
            )
        } else {
            let pos = n_prompt + t - 1;
            (vec![1000 + pos], vec![pos], Phase::Decode)
        };
        let s = e.step(
            &StepInput {
                turn: 0,
                phase,
                tokens: &tokens,
                positions: &positions,
            },
            &mut sink as &mut dyn RecordSink,
        )?;
        e.cache().audit().unwrap();
        assert!(e.cache().resident_bytes() <= budget);
        assert_eq!(
            e.cache().pinned_bytes(),
            0,
            "nothing stays pinned between steps"
        );
        assert!(
            lock(&watch).in_flight.is_empty(),
            "no read in flight between steps"
        );
        ran.states.push(e.backend().inner.state().to_vec());
        ran.stats.push(s);
        let log = e.flash_mut().inner.inner().log().to_vec();
        let already: usize = ran.requests.iter().map(Vec::len).sum();
        ran.requests.push(log[already..].to_vec());
    }
    let w = lock(&watch);
    assert!(w.violations.is_empty(), "{:?}", w.violations);
    ran.routes = sink
        .routes
        .iter()
        .map(|r| (r.step, r.layer, r.expert, r.residency))
        .collect();
    Ok(ran)
}

fn total(ran: &Ran, f: impl Fn(&StepStats) -> u64) -> u64 {
    ran.stats.iter().map(f).sum()
}

#[test]
fn prefetch_never_changes_the_output_and_does_prefetch() {
    for routes in [Routes::Seeded, Routes::Repeat, Routes::Rotate] {
        for overlap in [false, true] {
            let base = run(
                &Case {
                    overlap,
                    routes,
                    ..Default::default()
                },
                24,
            )
            .unwrap();
            assert_eq!(total(&base, |s| s.spec_issued), 0);
            for prefetch in [1, 2, 3] {
                let c = Case {
                    overlap,
                    routes,
                    prefetch,
                    ..Default::default()
                };
                let ran = run(&c, 24).unwrap();
                assert_eq!(
                    ran.states, base.states,
                    "prefetch {prefetch} overlap {overlap}"
                );
                assert!(
                    total(&ran, |s| s.spec_issued) > 0,
                    "prefetch {prefetch} issued nothing"
                );
                let spec_in_log = ran
                    .requests
                    .iter()
                    .flatten()
                    .filter(|r| r.speculative)
                    .count();
                assert!(spec_in_log > 0);
                let useful = total(&ran, |s| s.spec_useful);
                let residency2 = ran.routes.iter().filter(|r| r.3 == 2).count() as u64;
                assert_eq!(
                    useful, residency2,
                    "useful = residency-2 routings in decode"
                );
                assert!(total(&ran, |s| s.spec_read_bytes) <= total(&ran, |s| s.read_bytes));
            }
        }
    }
}

#[test]
fn repeated_routing_is_prefetched_and_useful() {
    let base = run(
        &Case {
            routes: Routes::Repeat,
            budget_experts: 6,
            ..Default::default()
        },
        16,
    )
    .unwrap();
    let ran = run(
        &Case {
            routes: Routes::Repeat,
            budget_experts: 6,
            prefetch: 1,
            ..Default::default()
        },
        16,
    )
    .unwrap();
    assert_eq!(ran.states, base.states);
    // 6 slots, 4 layers x 4 experts: every token misses everything (the cycle cliff) without
    // prefetch; with it, layers 1..3 are read ahead while the layer before computes.
    let misses = |r: &Ran| total(r, |s| s.misses);
    assert!(
        misses(&ran) < misses(&base),
        "{} vs {}",
        misses(&ran),
        misses(&base)
    );
    let experts = total(&ran, |s| s.spec_experts);
    let useful = total(&ran, |s| s.spec_useful);
    assert!(experts > 0);
    assert_eq!(useful, experts, "a perfect prediction is always useful");
}

#[test]
fn every_demand_miss_is_read_exactly_once() {
    for overlap in [false, true] {
        for prefetch in [1, 2] {
            let ran = run(
                &Case {
                    overlap,
                    prefetch,
                    ..Default::default()
                },
                20,
            )
            .unwrap();
            for (t, (reqs, s)) in ran.requests.iter().zip(&ran.stats).enumerate() {
                let mut demand: BTreeMap<(u16, u16, u8), u32> = BTreeMap::new();
                for r in reqs.iter().filter(|r| !r.speculative) {
                    *demand
                        .entry((r.tag.layer, r.tag.expert, r.tag.proj))
                        .or_default() += 1;
                }
                assert!(
                    demand.values().all(|&n| n == 1),
                    "step {t}: a demand read twice"
                );
                assert_eq!(
                    demand.len() as u64,
                    s.misses * PROJ.len() as u64,
                    "step {t}: misses and demand reads disagree"
                );
            }
        }
    }
}

#[test]
fn unneeded_speculation_is_cancelled_and_dropped() {
    // Prediction always wrong, one slow lane: speculative reads queue up and are still queued
    // when their layer begins, so they are cancelled.
    let c = Case {
        routes: Routes::Rotate,
        prefetch: 2,
        lanes: 1,
        latency_ns: 20_000,
        expert_ns: 500,
        budget_experts: 16,
        ..Default::default()
    };
    let ran = run(&c, 12).unwrap();
    assert_eq!(total(&ran, |s| s.spec_useful), 0);
    assert!(
        total(&ran, |s| s.spec_cancelled) > 0,
        "nothing was cancelled"
    );
    assert!(total(&ran, |s| s.spec_dropped) > 0, "nothing was dropped");
    let base = run(&Case { prefetch: 0, ..c }, 12).unwrap();
    assert_eq!(ran.states, base.states);
}

#[test]
fn pins_and_budget_hold_at_the_floor() {
    // A budget of exactly one layer's demand: speculation can only take what the layer's own
    // pins leave, and demand must always win.
    for overlap in [false, true] {
        for prefetch in [1, 4] {
            let c = Case {
                overlap,
                prefetch,
                budget_experts: u64::from(K),
                ..Default::default()
            };
            let ran = run(&c, 16).unwrap();
            let base = run(&Case { prefetch: 0, ..c }, 16).unwrap();
            assert_eq!(ran.states, base.states);
        }
        let c = Case {
            overlap,
            prefetch: 3,
            budget_experts: u64::from(K) + 2,
            ..Default::default()
        };
        let ran = run(&c, 16).unwrap();
        assert!(total(&ran, |s| s.spec_issued) > 0);
        assert_eq!(
            ran.states,
            run(&Case { prefetch: 0, ..c }, 16).unwrap().states
        );
    }
}

#[test]
fn prefetch_is_deterministic() {
    for overlap in [false, true] {
        let c = Case {
            overlap,
            prefetch: 2,
            ..Default::default()
        };
        let a = run(&c, 20).unwrap();
        let b = run(&c, 20).unwrap();
        assert_eq!(a, b);
    }
}

/// The index (in submission order) of the first speculative read of `step`.
fn first_spec_read(c: &Case, step: usize) -> u64 {
    let ran = run(c, 3).unwrap();
    let before: usize = ran.requests[..step].iter().map(Vec::len).sum();
    let i = ran.requests[step]
        .iter()
        .position(|r| r.speculative)
        .expect("a speculative read in that step");
    (before + i) as u64
}

#[test]
fn a_failed_speculative_read_is_fatal_only_when_needed() {
    // Wrong predictions: the failed read's expert is never needed, so the run goes on.
    let c = Case {
        routes: Routes::Rotate,
        prefetch: 1,
        ..Default::default()
    };
    let nth = first_spec_read(&c, 1);
    let ran = run(
        &Case {
            fault: Some(nth),
            ..c
        },
        3,
    )
    .unwrap();
    assert_eq!(total(&ran, |s| s.spec_failed), 1);
    assert_eq!(ran.states, run(&c, 3).unwrap().states);

    // Right predictions: the layer needs it, so its failure is the demand read's failure.
    let c = Case {
        routes: Routes::Repeat,
        prefetch: 1,
        budget_experts: 6,
        latency_ns: 200_000,
        ..Default::default()
    };
    let nth = first_spec_read(&c, 1);
    match run(
        &Case {
            fault: Some(nth),
            ..c
        },
        3,
    ) {
        Err(StepError::Flash { source, .. }) => {
            assert!(matches!(source, FlashError::Io { .. }), "{source}")
        }
        other => panic!("expected the needed speculative read's failure, got {other:?}"),
    }
}

#[test]
fn a_sweep_of_seeds_budgets_horizons_and_lanes_never_changes_the_output() {
    let mut issued = 0;
    for seed in 0..24u64 {
        let pick = |salt: u64, n: u64| bmoe_core::testing::splitmix64(seed ^ salt) % n;
        let c = Case {
            seed,
            prefetch: 1 + pick(1, 4) as u32,
            overlap: pick(2, 2) == 1,
            budget_experts: u64::from(K) + pick(3, 10),
            lanes: 1 + pick(4, 3) as u32,
            latency_ns: 500 + 1_000 * pick(5, 8),
            expert_ns: 200 + 500 * pick(6, 6),
            max_read_bytes: 16 * pick(7, 3),
            ..Default::default()
        };
        let ran = run(&c, 12).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        let base = run(&Case { prefetch: 0, ..c }, 12).unwrap();
        assert_eq!(ran.states, base.states, "seed {seed}");
        issued += total(&ran, |s| s.spec_issued);
    }
    assert!(issued > 0);
}
