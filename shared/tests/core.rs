//! Integration tests of bmoe-core: the decode step over the in-memory flash and the scripted
//! backend (serial vs overlap, cache off vs on, load-all, faults, timing, records,
//! determinism), proptests of the cache's guarantees, and an ignored replay-rate benchmark.

use bmoe_core::backend::{Backend, ExpertUse, LayerId, Routing, SlotId};
use bmoe_core::cache::{Admission, CacheError, ExpertCache, Lookup};
use bmoe_core::clock::{Clock, Nanos};
use bmoe_core::flash::{Flash, FlashError, ReadDone, ReadId, ReadRequest};
use bmoe_core::layout::{ExpertKey, ExpertLayout};
use bmoe_core::policy::Lru;
use bmoe_core::records::{NullSink, Phase};
use bmoe_core::step::{
    Engine, ReadSplit, StepError, StepInput, StepStats, StreamConfig, TopKOverride,
};
use bmoe_core::testing::{
    synthetic_model, Call, Fault, FaultyFlash, ManualClock, MemFlash, MemTiming, RecordingSink,
    RouteFn, ScriptBackend, ScriptCosts, SlotStore,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// A scenario: model shape, budget, stream config, timing.
#[derive(Clone)]
struct Scenario {
    n_layers: u32,
    n_expert: u32,
    k: u16,
    proj_bytes: Vec<u64>,
    budget_experts: Option<u64>, // None = cache off; Some(n) = room for n experts
    lanes: u32,
    config: StreamConfig,
    timing: MemTiming,
    costs: ScriptCosts,
    seed: u64,
    last_layer_last_row_only: bool,
}

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            n_layers: 4,
            n_expert: 16,
            k: 4,
            proj_bytes: vec![24, 24, 40],
            budget_experts: Some(24),
            lanes: 3,
            config: StreamConfig::default(),
            timing: MemTiming::default(),
            costs: ScriptCosts::default(),
            seed: 7,
            last_layer_last_row_only: true,
        }
    }
}

type Rig<F> = Engine<ManualClock, F, ScriptBackend>;

struct Parts {
    clock: ManualClock,
    store: SlotStore,
    layout: ExpertLayout,
    flash: MemFlash,
    backend: ScriptBackend,
    cache: ExpertCache,
}

fn parts(s: &Scenario) -> Parts {
    let layers: Vec<u32> = (0..s.n_layers).collect();
    let (layout, shards) =
        synthetic_model(s.n_layers, &layers, s.n_expert, s.k, &s.proj_bytes, s.seed).unwrap();
    let clock = ManualClock::new();
    let store = SlotStore::new();
    let flash = MemFlash::new(shards.clone(), s.lanes, clock.clone())
        .with_timing(s.timing)
        .with_store(store.clone());
    let mut backend = ScriptBackend::new(
        layout.clone(),
        shards,
        s.k as usize,
        s.seed,
        clock.clone(),
        s.costs,
    )
    .with_store(store.clone());
    backend.last_layer_last_row_only = s.last_layer_last_row_only;
    let budget = s
        .budget_experts
        .map_or(0, |n| n * layout.max_expert_bytes());
    let cache = ExpertCache::new(&layout, budget, s.k, Box::new(Lru::new())).unwrap();
    Parts {
        clock,
        store,
        layout,
        flash,
        backend,
        cache,
    }
}

fn engine(s: &Scenario) -> Rig<MemFlash> {
    let p = parts(s);
    Engine::new(p.clock, p.flash, p.backend, p.layout, p.cache, s.config).unwrap()
}

/// A prefill of `n_prompt` tokens, then `n_decode` single-token steps.
fn run_session<F: Flash>(
    e: &mut Rig<F>,
    n_prompt: u32,
    n_decode: u32,
    sink: &mut RecordingSink,
) -> Result<Vec<StepStats>, StepError> {
    let mut out = Vec::new();
    let tokens: Vec<u32> = (0..n_prompt).map(|i| 100 + i).collect();
    let positions: Vec<u32> = (0..n_prompt).collect();
    out.push(e.step(
        &StepInput {
            turn: 0,
            phase: Phase::Prefill,
            tokens: &tokens,
            positions: &positions,
        },
        sink,
    )?);
    for t in 0..n_decode {
        let pos = n_prompt + t;
        out.push(e.step(
            &StepInput {
                turn: 0,
                phase: Phase::Decode,
                tokens: &[1000 + pos],
                positions: &[pos],
            },
            sink,
        )?);
    }
    Ok(out)
}

/// Expert calls per MoE layer, as a sorted set (order-free), and the order of layer ends.
#[allow(clippy::type_complexity)]
fn expert_calls_by_step(log: &[Call]) -> (Vec<BTreeSet<String>>, Vec<LayerId>) {
    let mut per_layer = Vec::new();
    let mut current = BTreeSet::new();
    let mut finishes = Vec::new();
    for c in log {
        match c {
            Call::Expert {
                layer,
                expert,
                slot,
                uses,
                digests,
            } => {
                current.insert(format!("{layer:?} {expert} {slot:?} {uses:?} {digests:?}"));
            }
            Call::FinishLayer { layer } => {
                per_layer.push(std::mem::take(&mut current));
                finishes.push(*layer);
            }
            _ => {}
        }
    }
    (per_layer, finishes)
}

fn expert_order(log: &[Call]) -> Vec<(u16, u16)> {
    log.iter()
        .filter_map(|c| match c {
            Call::Expert { layer, expert, .. } => Some((layer.moe, *expert)),
            _ => None,
        })
        .collect()
}

#[test]
fn serial_and_overlap_compute_the_same_experts_on_the_same_bytes() {
    let timed = Scenario {
        timing: MemTiming {
            latency: Nanos(1_000),
            bytes_per_us: 10,
            align_bytes: 16,
        },
        costs: ScriptCosts {
            expert: Nanos(700),
            dense: Nanos(300),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut serial = engine(&timed);
    let mut overlap = engine(&Scenario {
        config: StreamConfig {
            overlap: true,
            ..Default::default()
        },
        ..timed.clone()
    });
    let (mut s1, mut s2) = (RecordingSink::default(), RecordingSink::default());
    let a = run_session(&mut serial, 5, 12, &mut s1).unwrap();
    let b = run_session(&mut overlap, 5, 12, &mut s2).unwrap();

    let (calls_a, fin_a) = expert_calls_by_step(serial.backend().log());
    let (calls_b, fin_b) = expert_calls_by_step(overlap.backend().log());
    assert_eq!(
        calls_a, calls_b,
        "same experts, slots, uses and bytes per layer"
    );
    assert_eq!(fin_a, fin_b, "same finish order");
    assert_eq!(serial.backend().state(), overlap.backend().state());
    // Overlap really reordered something (otherwise this test would prove nothing).
    assert_ne!(
        expert_order(serial.backend().log()),
        expert_order(overlap.backend().log())
    );
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(
            (
                x.reads,
                x.read_bytes,
                x.req_bytes,
                x.hits,
                x.misses,
                x.evictions
            ),
            (
                y.reads,
                y.read_bytes,
                y.req_bytes,
                y.hits,
                y.misses,
                y.evictions
            )
        );
        assert_eq!(x.stall, Nanos::ZERO);
        assert!(
            x.io <= x.wall && x.io <= x.lane_busy,
            "serial io is waited wall"
        );
        assert_eq!(y.io, y.lane_busy, "overlap io is lane busy time");
        assert!(y.stall <= y.wall);
        assert!(y.wall <= x.wall, "overlap is never slower here");
    }
    let stall: Nanos = b.iter().map(|s| s.stall).sum();
    let io: Nanos = a.iter().map(|s| s.io).sum();
    assert!(
        stall < io,
        "overlap hid some reads: stall {stall:?} io {io:?}"
    );
    // Alignment: read windows cover at least the request.
    assert!(a.iter().all(|s| s.read_bytes >= s.req_bytes));
    assert!(a.iter().any(|s| s.read_bytes > s.req_bytes));
    // Route records are identical; io records are the same set in a different order.
    assert_eq!(s1.routes, s2.routes);
    let key = |r: &bmoe_core::records::IoRecord| (r.step, r.layer, r.expert, r.proj, r.offset);
    let mut i1: Vec<_> = s1.ios.iter().map(key).collect();
    let mut i2: Vec<_> = s2.ios.iter().map(key).collect();
    i1.sort();
    i2.sort();
    assert_eq!(i1, i2);
}

#[test]
fn cache_off_streams_every_routed_expert_and_matches_cache_on() {
    let mut on = engine(&Scenario::default());
    let mut off = engine(&Scenario {
        budget_experts: None,
        ..Default::default()
    });
    let (mut r_on, mut r_off) = (RecordingSink::default(), RecordingSink::default());
    let s_on = run_session(&mut on, 6, 20, &mut r_on).unwrap();
    let s_off = run_session(&mut off, 6, 20, &mut r_off).unwrap();
    assert_eq!(on.backend().state(), off.backend().state());
    let n_proj = 3;
    for (x, y) in s_on.iter().zip(&s_off) {
        // Cache off: every distinct routed expert of every layer is read, every step.
        let distinct = y.routed_bytes / on.layout().expert_bytes(0);
        assert_eq!(y.reads, distinct * n_proj);
        assert_eq!(y.misses, distinct);
        assert_eq!(y.hits, 0);
        assert_eq!(x.hits + x.misses, distinct);
        assert_eq!(x.routed_bytes, y.routed_bytes);
    }
    let hits: u64 = s_on.iter().map(|s| s.hits).sum();
    assert!(
        hits > 0,
        "the skewed routing gives the cache something to hit"
    );
    assert!(off.backend().log().iter().all(|c| !matches!(
        c,
        Call::Expert {
            slot: SlotId::Canonical(_),
            ..
        }
    )));
    assert!(on.backend().log().iter().all(|c| !matches!(
        c,
        Call::Expert {
            slot: SlotId::Staging(_),
            ..
        }
    )));
    assert_eq!(off.cache().resident_bytes(), 0);
    // Staging slots are numbered by place in the layer's union, not by expert id: within a
    // layer (between FinishLayer calls) they are distinct and below the union's size, so a
    // decode step (one token, top-k experts) touches only the first k slots.
    let mut in_layer: Vec<(u16, u16)> = Vec::new();
    let mut widest = 0usize;
    for c in off.backend().log() {
        match c {
            Call::Expert {
                slot: SlotId::Staging(i),
                expert,
                ..
            } => in_layer.push((*i, *expert)),
            Call::FinishLayer { .. } => {
                let mut slots: Vec<u16> = in_layer.iter().map(|p| p.0).collect();
                slots.sort_unstable();
                slots.dedup();
                assert_eq!(
                    slots.len(),
                    in_layer.len(),
                    "a staging slot reused: {in_layer:?}"
                );
                assert!(
                    slots.iter().all(|&i| (i as usize) < in_layer.len()),
                    "{in_layer:?}"
                );
                widest = widest.max(in_layer.len());
                in_layer.clear();
            }
            _ => {}
        }
    }
    assert!(widest > 0);
    // Cache off traces every routing as a miss.
    assert!(r_off.routes.iter().all(|r| r.residency == 0));
}

#[test]
fn load_all_reads_every_expert_and_changes_nothing_computed() {
    let base = Scenario {
        budget_experts: None,
        ..Default::default()
    };
    let mut sel = engine(&base);
    let mut all = engine(&Scenario {
        config: StreamConfig {
            load_all: true,
            ..Default::default()
        },
        ..base.clone()
    });
    let mut sink = RecordingSink::default();
    run_session(&mut sel, 3, 5, &mut sink).unwrap();
    let stats = run_session(&mut all, 3, 5, &mut RecordingSink::default()).unwrap();
    for s in &stats {
        assert_eq!(s.req_bytes, all.layout().total_expert_bytes());
        assert_eq!(s.reads, 4 * 16 * 3);
    }
    assert_eq!(sel.backend().state(), all.backend().state());
    assert_eq!(
        expert_calls_by_step(sel.backend().log()),
        expert_calls_by_step(all.backend().log())
    );
}

#[test]
fn every_miss_is_read_once_and_hits_are_not_read() {
    let mut e = engine(&Scenario::default());
    let mut sink = RecordingSink::default();
    let stats = run_session(&mut e, 8, 30, &mut sink).unwrap();
    let log = e.flash().log().to_vec();
    let mut reads_by_step: Vec<BTreeMap<(u16, u16), u32>> = Vec::new();
    let mut cursor = 0usize;
    for s in &stats {
        let mut m = BTreeMap::new();
        for r in &log[cursor..cursor + s.reads as usize] {
            *m.entry((r.tag.layer, r.tag.expert)).or_insert(0) += 1;
        }
        cursor += s.reads as usize;
        assert!(m.values().all(|&n| n == 3), "one read per projection");
        assert_eq!(m.len() as u64, s.misses);
        reads_by_step.push(m);
    }
    assert_eq!(cursor, log.len());
    // Route records agree: bytes only on the first routing of a missed expert per batch.
    let mut bytes_rows: BTreeMap<(u8, i64, u32, u32), u32> = BTreeMap::new();
    for r in &sink.routes {
        if r.expert_bytes > 0 {
            assert_eq!(r.residency, 0);
            assert_eq!(r.expert_bytes, e.layout().expert_bytes(r.layer as u16));
            // The one prefill batch spans many steps (positions): key it as one.
            let step = if r.phase == Phase::Prefill {
                -1
            } else {
                r.step
            };
            *bytes_rows
                .entry((r.phase as u8, step, r.layer, r.expert))
                .or_insert(0) += 1;
        }
    }
    assert!(bytes_rows.values().all(|&n| n == 1));
    let traced_bytes: u64 = sink.routes.iter().map(|r| r.expert_bytes).sum();
    let req: u64 = stats.iter().map(|s| s.req_bytes).sum();
    assert_eq!(
        traced_bytes, req,
        "summing expert_bytes gives the bytes read"
    );
}

#[test]
fn prefill_unions_the_batch_and_the_last_layer_routes_only_the_last_token() {
    let mut e = engine(&Scenario {
        budget_experts: None,
        ..Default::default()
    });
    let mut sink = RecordingSink::default();
    let stats = run_session(&mut e, 9, 0, &mut sink).unwrap();
    let s = &stats[0];
    assert_eq!(s.tokens, 9);
    // Last MoE layer (3): one row, at the final prompt position.
    let last: Vec<_> = sink.routes.iter().filter(|r| r.layer == 3).collect();
    assert_eq!(last.len(), 4);
    assert!(last.iter().all(|r| r.step == 8));
    // Other layers: every prompt position, k rows each.
    assert_eq!(sink.routes.iter().filter(|r| r.layer == 0).count(), 9 * 4);
    // Union: distinct experts per layer, each read once.
    for layer in 0..4u32 {
        let distinct: BTreeSet<u32> = sink
            .routes
            .iter()
            .filter(|r| r.layer == layer)
            .map(|r| r.expert)
            .collect();
        assert_eq!(
            s.layer_routed_bytes[layer as usize],
            distinct.len() as u64 * e.layout().expert_bytes(0)
        );
        let reads = sink.ios.iter().filter(|r| r.layer == layer).count();
        assert_eq!(reads, distinct.len() * 3);
    }
    assert_eq!(s.experts_routed, 3 * 9 * 4 + 4);
}

#[test]
fn a_budget_below_the_prefill_union_admits_in_waves_and_stays_correct() {
    // Room for exactly one layer's k experts: a 12-token prefill routes far more per layer.
    let tight = Scenario {
        budget_experts: Some(4),
        ..Default::default()
    };
    let mut e = engine(&tight);
    let mut off = engine(&Scenario {
        budget_experts: None,
        ..Default::default()
    });
    let stats = run_session(&mut e, 12, 10, &mut RecordingSink::default()).unwrap();
    run_session(&mut off, 12, 10, &mut RecordingSink::default()).unwrap();
    assert!(stats[0].extra_waves > 0);
    assert!(
        stats[1..].iter().all(|s| s.extra_waves == 0),
        "decode fits one wave"
    );
    assert_eq!(e.backend().state(), off.backend().state());
    assert!(e.cache().resident_bytes() <= e.cache().budget_bytes());
    assert_eq!(e.cache().pinned_bytes(), 0);
    e.cache().audit().unwrap();
}

#[test]
fn an_overlapped_prefill_wider_than_the_budget_slides_its_window_and_reads_each_expert_once() {
    // Room for 4 experts (the floor, k = 4): a 12-token prefill routes many more per layer.
    let tight = |lanes: u32, latency: u64| Scenario {
        budget_experts: Some(4),
        lanes,
        config: StreamConfig {
            overlap: true,
            ..Default::default()
        },
        timing: MemTiming {
            latency: Nanos(latency),
            ..Default::default()
        },
        costs: ScriptCosts {
            expert: Nanos(5),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut off = engine(&Scenario {
        budget_experts: None,
        config: StreamConfig {
            overlap: true,
            ..Default::default()
        },
        ..Default::default()
    });
    run_session(&mut off, 12, 10, &mut RecordingSink::default()).unwrap();
    let mut logs = Vec::new();
    for (lanes, latency) in [(3, 10), (1, 37), (2, 3)] {
        let mut e = engine(&tight(lanes, latency));
        let mut sink = RecordingSink::default();
        let stats = run_session(&mut e, 12, 10, &mut sink).unwrap();
        assert!(
            stats[0].extra_waves > 0,
            "the prefill's union exceeds the budget"
        );
        // Each (layer, expert) of the prefill read exactly once: every projection once.
        let mut reads: BTreeMap<(u32, u32, u8), u32> = BTreeMap::new();
        for r in sink.ios.iter().filter(|r| r.phase == Phase::Prefill) {
            *reads.entry((r.layer, r.expert, r.proj)).or_insert(0) += 1;
        }
        assert!(!reads.is_empty());
        assert!(reads.values().all(|&n| n == 1), "{reads:?}");
        let experts: BTreeSet<(u32, u32)> = reads.keys().map(|&(l, x, _)| (l, x)).collect();
        assert_eq!(reads.len(), experts.len() * 3);
        assert_eq!(stats[0].misses, experts.len() as u64);
        // Same computed state as the cache-off run; the cache within its budget, unpinned.
        assert_eq!(e.backend().state(), off.backend().state());
        assert!(e.cache().resident_bytes() <= e.cache().budget_bytes());
        assert_eq!(e.cache().pinned_bytes(), 0);
        e.cache().audit().unwrap();
        // The reads are submitted in the same order whatever the read timing: the window
        // unpins in admission order, so the cache operations do not depend on when reads land.
        let log: Vec<(u16, u16, u8)> = e
            .flash()
            .log()
            .iter()
            .map(|r| (r.tag.layer, r.tag.expert, r.tag.proj))
            .collect();
        logs.push((log, e.cache().resident_keys()));
    }
    assert!(logs.windows(2).all(|w| w[0] == w[1]));
    // With the same lanes, the requests themselves — where each extent is cut, and so the
    // aligned bytes read — do not depend on how fast reads land either (a slid-in expert was
    // once cut by the count of reads in flight, which is timing: the engine under load read
    // other bytes than the simulator's replay).
    let requests = |latency: u64| {
        // More lanes than one expert's three extents, extents large enough to cut, and
        // `--read-split auto`: whether a slid-in expert is cut into lane pieces is what a
        // count of reads in flight would decide.
        let mut s = tight(8, latency);
        s.proj_bytes = vec![256 << 10, 256 << 10, 512 << 10];
        s.config.read_split = ReadSplit::Auto;
        let mut e = engine(&s);
        run_session(&mut e, 12, 10, &mut RecordingSink::default()).unwrap();
        e.flash()
            .log()
            .iter()
            .map(|r| (r.tag.layer, r.tag.expert, r.tag.proj, r.offset, r.len))
            .collect::<Vec<_>>()
    };
    let fast = requests(1);
    assert!(fast.len() > 3 * 12, "the prefill reads");
    for latency in [7, 40, 400] {
        assert_eq!(requests(latency), fast, "read latency {latency} ns");
    }
}

/// One layer, room for 2 experts, a 2-token prefill routing experts 0, 1 | 2, 0 (union of 3
/// misses), one projection read in 10 ns on one lane, 5 ns of compute per expert.
fn window_schedule(overlap: bool) -> StepStats {
    let s = Scenario {
        n_layers: 1,
        n_expert: 4,
        k: 2,
        proj_bytes: vec![8],
        budget_experts: Some(2),
        lanes: 1,
        config: StreamConfig {
            overlap,
            ..Default::default()
        },
        timing: MemTiming {
            latency: Nanos(10),
            ..Default::default()
        },
        costs: ScriptCosts {
            expert: Nanos(5),
            ..Default::default()
        },
        last_layer_last_row_only: false,
        ..Default::default()
    };
    let p = parts(&s);
    let routes: RouteFn = Box::new(|_, pos, _, _| if pos == 0 { vec![0, 1] } else { vec![2, 0] });
    let backend = p.backend.with_routes(routes);
    let mut e = Engine::new(p.clock, p.flash, backend, p.layout, p.cache, s.config).unwrap();
    e.step(
        &StepInput {
            turn: 0,
            phase: Phase::Prefill,
            tokens: &[1, 2],
            positions: &[0, 1],
        },
        &mut NullSink,
    )
    .unwrap()
}

#[test]
fn the_window_admits_the_next_miss_as_soon_as_its_head_is_computed() {
    // Overlap: reads of 0 and 1 at 0-10 and 10-20 (stall 10); 0 computed 10-15, then unpinned
    // and 2 admitted at once: its read queues behind 1's, 20-30. 1 computed 20-25 (stall 5),
    // 2 at 30-35 (stall 5). Waves would have read 2 only after 1's compute: 25-35, done at 40.
    let o = window_schedule(true);
    assert_eq!((o.wall, o.io, o.stall), (Nanos(35), Nanos(30), Nanos(20)));
    assert_eq!((o.misses, o.reads, o.extra_waves), (3, 3, 1));
    // Serial keeps waves: 0 and 1 read (0-20), computed (20-30), then 2 read and computed.
    let s = window_schedule(false);
    assert_eq!((s.wall, s.io, s.stall), (Nanos(45), Nanos(30), Nanos(0)));
    assert_eq!((s.misses, s.reads, s.extra_waves), (3, 3, 1));
}

/// The hand-computed schedule: one layer, two missed experts, three 10 ns reads each,
/// 5 ns of compute per expert.
fn two_miss_schedule(lanes: u32, overlap: bool) -> StepStats {
    let s = Scenario {
        n_layers: 1,
        n_expert: 4,
        k: 2,
        proj_bytes: vec![8, 8, 8],
        budget_experts: Some(4),
        lanes,
        config: StreamConfig {
            overlap,
            ..Default::default()
        },
        timing: MemTiming {
            latency: Nanos(10),
            ..Default::default()
        },
        costs: ScriptCosts {
            expert: Nanos(5),
            ..Default::default()
        },
        ..Default::default()
    };
    let p = parts(&s);
    let routes: RouteFn = Box::new(|_, _, _, _| vec![2, 1]);
    let backend = p.backend.with_routes(routes);
    let mut e = Engine::new(p.clock, p.flash, backend, p.layout, p.cache, s.config).unwrap();
    e.step(
        &StepInput {
            turn: 0,
            phase: Phase::Decode,
            tokens: &[1],
            positions: &[0],
        },
        &mut NullSink,
    )
    .unwrap()
}

#[test]
fn io_and_stall_follow_the_hand_computed_schedule() {
    // One lane: reads end at 10..60. Serial waits 60, then computes 10.
    let s = two_miss_schedule(1, false);
    assert_eq!((s.wall, s.io, s.stall), (Nanos(70), Nanos(60), Nanos(0)));
    // Overlap: expert 2 is ready at 30 (stall 30), computed by 35; expert 1 at 60 (stall 25).
    let o = two_miss_schedule(1, true);
    assert_eq!((o.wall, o.io, o.stall), (Nanos(65), Nanos(60), Nanos(55)));
    // Two lanes: serial waits 30; overlap stalls 20 + 5 and ends at 35; io is lane busy (60).
    let s = two_miss_schedule(2, false);
    assert_eq!((s.wall, s.io, s.stall), (Nanos(40), Nanos(30), Nanos(0)));
    let o = two_miss_schedule(2, true);
    assert_eq!((o.wall, o.io, o.stall), (Nanos(35), Nanos(60), Nanos(25)));
    assert_eq!(o.lane_busy, Nanos(60));
}

#[test]
fn mgmt_time_is_what_the_clock_saw_during_cache_work() {
    let mut e = engine(&Scenario {
        budget_experts: Some(6),
        costs: ScriptCosts {
            release: Nanos(7),
            expert: Nanos(100),
            ..Default::default()
        },
        ..Default::default()
    });
    let stats = run_session(&mut e, 4, 20, &mut RecordingSink::default()).unwrap();
    let evictions: u64 = stats.iter().map(|s| s.evictions).sum();
    assert!(evictions > 0);
    for s in &stats {
        assert_eq!(s.mgmt, Nanos(7 * s.evictions));
    }
    let releases = e
        .backend()
        .log()
        .iter()
        .filter(|c| matches!(c, Call::Release { .. }))
        .count() as u64;
    assert_eq!(releases, evictions);
}

fn faulty_engine(s: &Scenario, nth: u64, fault: Fault) -> Rig<FaultyFlash<MemFlash>> {
    let p = parts(s);
    let flash = FaultyFlash::new(p.flash, nth, fault);
    Engine::new(p.clock, flash, p.backend, p.layout, p.cache, s.config).unwrap()
}

#[test]
fn a_failed_or_short_read_fails_the_step_and_poisons_the_engine() {
    for overlap in [false, true] {
        for fault in [
            Fault::Eio,
            Fault::Short { got: 3 },
            Fault::SilentShort { got: 3 },
        ] {
            let s = Scenario {
                config: StreamConfig {
                    overlap,
                    ..Default::default()
                },
                timing: MemTiming {
                    latency: Nanos(10),
                    ..Default::default()
                },
                ..Default::default()
            };
            let mut e = faulty_engine(&s, 40, fault);
            let err = run_session(&mut e, 4, 20, &mut RecordingSink::default()).unwrap_err();
            assert!(e.flash().injected(), "{fault:?}");
            match (&err, fault) {
                (
                    StepError::Flash {
                        source: FlashError::Io { .. },
                        ..
                    },
                    Fault::Eio,
                )
                | (
                    StepError::Flash {
                        source: FlashError::Short { .. },
                        ..
                    },
                    Fault::Short { .. } | Fault::SilentShort { .. },
                ) => {}
                _ => panic!("{fault:?} overlap={overlap}: unexpected error {err}"),
            }
            // Nothing is left in flight once the step gave up.
            assert_eq!(e.flash().inner().in_flight(), 0);
            let again = e.step(
                &StepInput {
                    turn: 0,
                    phase: Phase::Decode,
                    tokens: &[1],
                    positions: &[99],
                },
                &mut NullSink,
            );
            assert!(matches!(again, Err(StepError::Poisoned { .. })));
            assert!(e.failure().is_some());
        }
    }
}

#[test]
fn a_backend_error_fails_the_step_and_poisons_the_engine() {
    let s = Scenario::default();
    let p = parts(&s);
    let backend = p.backend.fail_expert_call(10);
    let mut e = Engine::new(p.clock, p.flash, backend, p.layout, p.cache, s.config).unwrap();
    let err = run_session(&mut e, 2, 10, &mut RecordingSink::default()).unwrap_err();
    assert!(matches!(
        err,
        StepError::Backend {
            stage: bmoe_core::backend::BackendStage::Expert,
            ..
        }
    ));
    assert!(matches!(
        e.step(
            &StepInput {
                turn: 0,
                phase: Phase::Decode,
                tokens: &[1],
                positions: &[50],
            },
            &mut NullSink
        ),
        Err(StepError::Poisoned { .. })
    ));
}

#[test]
fn a_bad_routing_is_refused() {
    let s = Scenario::default();
    let p = parts(&s);
    let routes: RouteFn = Box::new(|_, _, _, _| vec![3, 99]);
    let backend = p.backend.with_routes(routes);
    let mut e = Engine::new(p.clock, p.flash, backend, p.layout, p.cache, s.config).unwrap();
    let err = run_session(&mut e, 1, 0, &mut RecordingSink::default()).unwrap_err();
    assert!(matches!(err, StepError::Routing { layer: 0, .. }), "{err}");
    // Bad input is refused without poisoning.
    let mut e = engine(&s);
    let bad = e.step(
        &StepInput {
            turn: 0,
            phase: Phase::Decode,
            tokens: &[1, 2],
            positions: &[0],
        },
        &mut NullSink,
    );
    assert!(matches!(bad, Err(StepError::BadInput { .. })));
    assert!(e.failure().is_none());
}

#[test]
fn n_expert_used_override_narrows_every_routing() {
    let s = Scenario {
        budget_experts: Some(4),
        ..Default::default()
    };
    let mut e = engine(&s);
    e.add_hook(Box::new(TopKOverride {
        k: 2,
        gating: bmoe_core::Gating::SOFTMAX_RENORM,
    }));
    let mut sink = RecordingSink::default();
    let stats = run_session(&mut e, 3, 6, &mut sink).unwrap();
    assert!(sink.routes.iter().all(|r| r.slot < 2));
    // Kept weights are renormalised: each (phase, step, layer) cell sums to 1.
    let mut cells: BTreeMap<(u8, i64, u32), f32> = BTreeMap::new();
    for r in &sink.routes {
        *cells.entry((r.phase as u8, r.step, r.layer)).or_insert(0.0) += r.weight;
    }
    assert!(cells.values().all(|w| (w - 1.0).abs() < 1e-6));
    assert!(stats[1..].iter().all(|s| s.experts_routed == 4 * 2));
    assert!(e
        .backend()
        .log()
        .iter()
        .all(|c| !matches!(c, Call::Expert { uses, .. } if uses.iter().any(|u| u.rank >= 2))));
}

#[test]
fn same_inputs_give_identical_stats_and_records() {
    let s = Scenario {
        config: StreamConfig {
            overlap: true,
            read_split: bmoe_core::ReadSplit::MaxBytes(16),
            ..Default::default()
        },
        timing: MemTiming {
            latency: Nanos(500),
            bytes_per_us: 3,
            align_bytes: 8,
        },
        costs: ScriptCosts {
            expert: Nanos(900),
            dense: Nanos(200),
            release: Nanos(3),
            ..Default::default()
        },
        budget_experts: Some(10),
        ..Default::default()
    };
    let run = || {
        let mut e = engine(&s);
        let mut sink = RecordingSink::default();
        let stats = run_session(&mut e, 7, 25, &mut sink).unwrap();
        (
            stats,
            sink,
            e.backend().log().to_vec(),
            e.flash().log().to_vec(),
        )
    };
    let a = run();
    let b = run();
    assert_eq!(a.0, b.0);
    assert_eq!(a.1, b.1);
    assert_eq!(a.2, b.2);
    assert_eq!(a.3, b.3);
    // Chunking split every 24- and 40-byte projection into 16-byte reads.
    assert!(a.3.iter().all(|r| r.len <= 16));
}

#[test]
fn reads_go_round_robin_over_the_lanes_and_land_in_their_slot() {
    let mut e = engine(&Scenario {
        lanes: 4,
        ..Default::default()
    });
    run_session(&mut e, 1, 0, &mut RecordingSink::default()).unwrap();
    // One cold decode-sized step: every layer reads k experts x 3 projections, and its
    // lanes cycle 0, 1, 2, 3, 0, ... from lane 0.
    let log = e.flash().log();
    assert_eq!(log.len(), 4 * 4 * 3);
    for (i, r) in log.iter().enumerate() {
        assert_eq!(r.tag.layer as usize, i / 12);
        assert_eq!(r.lane as usize, (i % 12) % 4);
        assert_eq!(r.tag.proj as usize, i % 3);
        assert_eq!(
            r.dest,
            SlotId::Canonical(ExpertKey {
                layer: r.tag.layer,
                expert: r.tag.expert
            })
        );
        assert_eq!((r.dest_offset, r.len), (0, [24, 24, 40][i % 3]));
        assert!(!r.speculative);
    }
}

#[test]
fn shrinking_the_budget_releases_what_it_evicts() {
    let mut e = engine(&Scenario::default());
    run_session(&mut e, 4, 10, &mut RecordingSink::default()).unwrap();
    let before = e.cache().resident_count();
    let floor = e.cache().layer_demand_bytes();
    e.set_cache_budget(floor).unwrap();
    assert!(e.cache().resident_bytes() <= floor);
    let released = e
        .backend()
        .log()
        .iter()
        .rev()
        .take_while(|c| matches!(c, Call::Release { .. }))
        .count() as u32;
    assert_eq!(released, before - e.cache().resident_count());
    assert!(matches!(
        e.set_cache_budget(floor - 1),
        Err(StepError::Cache(CacheError::BudgetBelowLayerDemand { .. }))
    ));
}

#[test]
fn engine_checks_its_parts() {
    let s = Scenario::default();
    let p = parts(&s);
    let other = Scenario {
        n_expert: 8,
        ..Default::default()
    };
    let q = parts(&other);
    assert!(matches!(
        Engine::new(p.clock, p.flash, p.backend, p.layout, q.cache, s.config),
        Err(StepError::CacheLayoutMismatch { .. })
    ));
    let _ = p.store;
}

mod cache_properties {
    use super::*;
    use bmoe_core::layout::{MoeLayerLayout, ProjExtent};
    use proptest::prelude::*;

    fn layout_strategy() -> impl Strategy<Value = ExpertLayout> {
        (
            1u32..4,
            2u32..12,
            1u16..4,
            proptest::collection::vec(1u64..50, 1..4),
        )
            .prop_map(|(n_layers, n_expert, k, strides)| {
                let layers = (0..n_layers)
                    .map(|m| MoeLayerLayout {
                        model_layer: m,
                        // Vary the width by layer.
                        n_expert: n_expert + m,
                        projections: strides
                            .iter()
                            .map(|&s| ProjExtent {
                                shard: 0,
                                base_offset: 0,
                                stride_bytes: s + u64::from(m),
                            })
                            .collect(),
                        dense_bytes: 0,
                    })
                    .collect();
                ExpertLayout::new(n_layers, layers, k.min(n_expert as u16)).unwrap()
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Direct cache operations in the streamer's protocol: never over budget, a pinned
        /// key is never evicted, hits + misses = lookups.
        #[test]
        fn cache_protocol_keeps_its_invariants(
            layout in layout_strategy(),
            extra in 0u64..400,
            steps in proptest::collection::vec(proptest::collection::vec(any::<u16>(), 1..24), 1..40),
        ) {
            let k = layout.n_expert_used();
            let budget = layout.layer_demand_bytes(k) + extra;
            let mut cache = ExpertCache::new(&layout, budget, k, Box::new(Lru::new())).unwrap();
            let mut lookups = 0u64;
            let mut evicted = Vec::new();
            for draws in &steps {
                for m in 0..layout.n_moe_layers() {
                    let n = layout.layer(m).unwrap().n_expert;
                    let mut union: Vec<u16> = Vec::new();
                    for &d in draws {
                        let e = d % n as u16;
                        if !union.contains(&e) { union.push(e); }
                    }
                    let mut pinned = Vec::new();
                    let mut misses = Vec::new();
                    for &e in &union {
                        let key = ExpertKey { layer: m, expert: e };
                        lookups += 1;
                        match cache.lookup(key).unwrap() {
                            Lookup::Hit => pinned.push(key),
                            Lookup::Miss { .. } => misses.push(key),
                        }
                    }
                    let mut i = 0;
                    while i < misses.len() {
                        evicted.clear();
                        match cache.admit(misses[i], &mut evicted).unwrap() {
                            Admission::Admitted => { pinned.push(misses[i]); i += 1; }
                            Admission::NoRoom => {
                                prop_assert!(evicted.is_empty());
                                prop_assert!(!pinned.is_empty(), "NoRoom with nothing pinned");
                                for key in pinned.drain(..) { cache.unpin(key).unwrap(); }
                            }
                            Admission::Bypassed => prop_assert!(false, "admit never bypasses"),
                        }
                        for v in &evicted {
                            prop_assert!(!pinned.contains(v), "evicted pinned {:?}", v);
                        }
                        prop_assert!(cache.resident_bytes() <= budget);
                    }
                    for key in pinned.drain(..) { cache.unpin(key).unwrap(); }
                    prop_assert_eq!(cache.pinned_bytes(), 0);
                }
                cache.audit().unwrap();
            }
            let c = cache.counters();
            prop_assert_eq!(c.hits + c.misses, lookups);
            prop_assert_eq!(c.inserts, c.misses);
        }

        /// Free-form operation sequences (pins held across other lookups, so a pinned entry
        /// can drift to the policy's tail): a pinned key is never evicted, the budget holds.
        #[test]
        fn random_operations_never_evict_a_pinned_entry(
            layout in layout_strategy(),
            extra in 0u64..200,
            ops in proptest::collection::vec((0u8..3, any::<u16>(), any::<u16>()), 1..300),
        ) {
            let k = layout.n_expert_used();
            let budget = layout.layer_demand_bytes(k) + extra;
            let mut cache = ExpertCache::new(&layout, budget, k, Box::new(Lru::new())).unwrap();
            let mut pins: BTreeMap<ExpertKey, u32> = BTreeMap::new();
            let mut evicted = Vec::new();
            for (op, l, e) in ops {
                let m = l % layout.n_moe_layers();
                let key = ExpertKey { layer: m, expert: e % layout.layer(m).unwrap().n_expert as u16 };
                match op {
                    0 => {
                        if cache.lookup(key).unwrap() == Lookup::Hit {
                            *pins.entry(key).or_default() += 1;
                        }
                    }
                    1 => {
                        if !cache.contains(key) {
                            evicted.clear();
                            if cache.admit(key, &mut evicted).unwrap() == Admission::Admitted {
                                *pins.entry(key).or_default() += 1;
                            }
                            for v in &evicted {
                                prop_assert!(!pins.contains_key(v), "evicted pinned {:?}", v);
                            }
                        }
                    }
                    _ => {
                        // Unpin the pinned key nearest `key` in order, if any.
                        let target = pins.range(key..).next().or_else(|| pins.iter().next()).map(|(k, _)| *k);
                        if let Some(t) = target {
                            cache.unpin(t).unwrap();
                            let n = pins.get_mut(&t).unwrap();
                            *n -= 1;
                            if *n == 0 { pins.remove(&t); }
                        }
                    }
                }
                prop_assert!(cache.resident_bytes() <= budget);
                for p in pins.keys() { prop_assert!(cache.is_pinned(*p)); }
            }
            cache.audit().unwrap();
        }

        /// Through the whole step: random routings (including wide prefill batches), random
        /// budgets, cache on or off, serial or overlap. The scripted backend fails the step if
        /// it ever computes on bytes that are not the expert's (which an evicted pinned entry
        /// or an unread miss would cause).
        #[test]
        fn step_reads_each_miss_once_and_never_exceeds_the_budget(
            n_layers in 1u32..4,
            n_expert in 2u32..20,
            k in 1u16..5,
            budget_extra in proptest::option::of(0u64..6),
            overlap in any::<bool>(),
            lanes in 1u32..5,
            batches in proptest::collection::vec(1u32..6, 1..8),
            seed in any::<u64>(),
        ) {
            let k = k.min(n_expert as u16);
            let s = Scenario {
                n_layers,
                n_expert,
                k,
                proj_bytes: vec![8, 12, 16],
                budget_experts: budget_extra.map(|x| u64::from(k) + x),
                lanes,
                config: StreamConfig { overlap, ..Default::default() },
                timing: MemTiming { latency: Nanos(3), bytes_per_us: 1, align_bytes: 0 },
                costs: ScriptCosts { expert: Nanos(5), ..Default::default() },
                seed,
                last_layer_last_row_only: seed % 2 == 0,
            };
            let mut e = engine(&s);
            let mut pos = 0u32;
            for &n in &batches {
                let tokens: Vec<u32> = (0..n).collect();
                let positions: Vec<u32> = (pos..pos + n).collect();
                pos += n;
                let before = e.flash().log().len();
                let mut sink = RecordingSink::default();
                let st = e.step(
                    &StepInput { turn: 0, phase: if n > 1 { Phase::Prefill } else { Phase::Decode }, tokens: &tokens, positions: &positions },
                    &mut sink,
                ).unwrap();
                let reads = &e.flash().log()[before..];
                let mut per_key: BTreeMap<(u16, u16), usize> = BTreeMap::new();
                for r in reads { *per_key.entry((r.tag.layer, r.tag.expert)).or_default() += 1; }
                prop_assert!(per_key.values().all(|&c| c == 3), "a miss read more than once");
                prop_assert_eq!(per_key.len() as u64, st.misses);
                let mut distinct: BTreeSet<(u32, u32)> = BTreeSet::new();
                for r in &sink.routes { distinct.insert((r.layer, r.expert)); }
                prop_assert_eq!(st.hits + st.misses, distinct.len() as u64);
                prop_assert!(e.cache().resident_bytes() <= e.cache().budget_bytes() || e.cache().is_off());
                prop_assert_eq!(e.cache().pinned_bytes(), 0);
                e.cache().audit().unwrap();
            }
        }
    }
}

/// Replay-rate benchmark (not a test): `cargo test -p bmoe-core --release --test core --
/// --ignored --nocapture bench_`. Prints routings per second through the cache alone and
/// through the full step with a do-nothing backend and an instant flash device.
mod bench {
    use super::*;
    use std::collections::VecDeque;
    use std::time::Instant;

    const LAYERS: u16 = 48;
    const EXPERTS: u32 = 128;
    const K: usize = 8;
    const TOKENS: usize = 20_000;

    fn routes() -> Vec<u16> {
        let mut out = Vec::with_capacity(TOKENS * LAYERS as usize * K);
        let mut s = 42u64;
        for _ in 0..TOKENS {
            for _ in 0..LAYERS {
                let start = out.len();
                while out.len() - start < K {
                    s = bmoe_core::testing::splitmix64(s);
                    let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                    let e = (u * u * f64::from(EXPERTS)) as u16;
                    if !out[start..].contains(&e) {
                        out.push(e);
                    }
                }
            }
        }
        out
    }

    fn layout() -> ExpertLayout {
        let (l, _) = synthetic_model(
            u32::from(LAYERS),
            &(0..u32::from(LAYERS)).collect::<Vec<_>>(),
            EXPERTS,
            K as u16,
            &[1, 1, 1],
            1,
        )
        .unwrap();
        l
    }

    #[test]
    #[ignore]
    fn bench_cache_replay_rate() {
        let layout = layout();
        let routes = routes();
        let budget = layout.total_expert_bytes() * 2 / 5;
        let mut cache = ExpertCache::new(&layout, budget, K as u16, Box::new(Lru::new())).unwrap();
        let mut evicted = Vec::new();
        let mut misses = Vec::with_capacity(K);
        let t = Instant::now();
        for (cell, ids) in routes.chunks(K).enumerate() {
            let layer = (cell % LAYERS as usize) as u16;
            misses.clear();
            for &e in ids {
                let key = ExpertKey { layer, expert: e };
                if cache.lookup(key).unwrap() != Lookup::Hit {
                    misses.push(key);
                }
            }
            for &key in &misses {
                evicted.clear();
                cache.admit(key, &mut evicted).unwrap();
            }
            for &e in ids {
                cache.unpin(ExpertKey { layer, expert: e }).unwrap();
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let c = cache.counters();
        println!(
            "cache only: {:.1} M routings/s ({} routings, hit {:.1}%)",
            routes.len() as f64 / secs / 1e6,
            routes.len(),
            100.0 * c.hits as f64 / (c.hits + c.misses) as f64
        );
    }

    /// Routes from a table, computes nothing.
    struct ReplayBackend {
        routes: Arc<Vec<u16>>,
        token: usize,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("replay")]
    struct ReplayError;

    impl Backend for ReplayBackend {
        type Error = ReplayError;
        fn begin(&mut self, _: &[u32], positions: &[u32]) -> Result<(), ReplayError> {
            self.token = positions[0] as usize;
            Ok(())
        }
        fn dense(&mut self, _: u32) -> Result<(), ReplayError> {
            Ok(())
        }
        fn route(&mut self, layer: LayerId, routing: &mut Routing) -> Result<(), ReplayError> {
            let s = (self.token * LAYERS as usize + layer.moe as usize) * K;
            routing
                .push_row(0, &self.routes[s..s + K], &[0.125; K])
                .map_err(|_| ReplayError)
        }
        fn expert(
            &mut self,
            _: LayerId,
            _: u16,
            _: SlotId,
            _: &[ExpertUse],
        ) -> Result<(), ReplayError> {
            Ok(())
        }
        fn finish_layer(&mut self, _: LayerId) -> Result<(), ReplayError> {
            Ok(())
        }
        fn head(&mut self) -> Result<(), ReplayError> {
            Ok(())
        }
        fn release(&mut self, _: SlotId) -> Result<(), ReplayError> {
            Ok(())
        }
    }

    /// Completes every read at submit time.
    #[derive(Default)]
    struct InstantFlash {
        next: u64,
        done: VecDeque<ReadDone>,
    }

    impl Flash for InstantFlash {
        fn lanes(&self) -> u32 {
            4
        }
        fn submit(&mut self, r: ReadRequest) -> ReadId {
            let id = ReadId(self.next);
            self.next += 1;
            self.done.push_back(ReadDone {
                id,
                lane: r.lane,
                req_bytes: r.len,
                read_bytes: r.len,
                submit: Nanos::ZERO,
                start: Nanos::ZERO,
                end: Nanos::ZERO,
            });
            id
        }
        fn wait(&mut self, id: ReadId) -> Result<ReadDone, FlashError> {
            let i = self
                .done
                .iter()
                .position(|d| d.id == id)
                .ok_or(FlashError::UnknownRead { id })?;
            self.done.remove(i).ok_or(FlashError::UnknownRead { id })
        }
        fn poll(&mut self) -> Option<(ReadId, Result<ReadDone, FlashError>)> {
            self.done.pop_front().map(|d| (d.id, Ok(d)))
        }
        fn cancel(&mut self, _: ReadId) -> bool {
            false
        }
    }

    struct ZeroClock;
    impl Clock for ZeroClock {
        fn now(&self) -> Nanos {
            Nanos::ZERO
        }
    }

    #[test]
    #[ignore]
    fn bench_step_replay_rate() {
        let layout = layout();
        let routes = Arc::new(routes());
        for overlap in [false, true] {
            let budget = layout.total_expert_bytes() * 2 / 5;
            let cache = ExpertCache::new(&layout, budget, K as u16, Box::new(Lru::new())).unwrap();
            let backend = ReplayBackend {
                routes: routes.clone(),
                token: 0,
            };
            let mut e = Engine::new(
                ZeroClock,
                InstantFlash::default(),
                backend,
                layout.clone(),
                cache,
                StreamConfig {
                    overlap,
                    ..Default::default()
                },
            )
            .unwrap();
            let t = Instant::now();
            let mut hits = 0;
            for tok in 0..TOKENS as u32 {
                let s = e
                    .step(
                        &StepInput {
                            turn: 0,
                            phase: Phase::Decode,
                            tokens: &[0],
                            positions: &[tok],
                        },
                        &mut NullSink,
                    )
                    .unwrap();
                hits += s.hits;
            }
            let secs = t.elapsed().as_secs_f64();
            let n = routes.len() as f64;
            println!(
                "full step (overlap={overlap}): {:.1} M routings/s, {:.0} tokens/s, hit {:.1}%",
                n / secs / 1e6,
                TOKENS as f64 / secs,
                100.0 * hits as f64 / n
            );
        }
    }
}
