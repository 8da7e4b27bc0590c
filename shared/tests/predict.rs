//! Tests of the expert predictors (`predict.rs`) through the decode step, over the in-memory
//! flash and the scripted backend with a scripted `predict`: the probe grades what it should
//! (a perfect predictor at 100%, layer 0 and the first token unscored) and changes nothing;
//! predicted prefetch changes only when bytes arrive and is used when the prediction is right;
//! sync speculation completes every read where it is issued; the route trace carries the
//! predictions; route-ahead without router probabilities passes everything through.

use bmoe_core::backend::LayerId;
use bmoe_core::cache::ExpertCache;
use bmoe_core::clock::Nanos;
use bmoe_core::policy::Lru;
use bmoe_core::predict::PredictConfig;
use bmoe_core::records::{Phase, RecordSink};
use bmoe_core::step::{Engine, StepInput, StepStats, StreamConfig};
use bmoe_core::testing::{
    splitmix64, synthetic_model, ManualClock, MemFlash, MemTiming, RecordingSink, ScriptBackend,
    ScriptCosts, SlotStore,
};

const N_LAYERS: u32 = 4;
const N_EXPERT: u32 = 16;
const K: u16 = 4;
const PROJ: [u64; 3] = [24, 24, 40];
const N_PROMPT: u32 = 5;

/// The scripted router: a seeded skewed draw per (layer, position).
fn route_of(layer: u16, pos: u32, k: usize, n: u32) -> Vec<u16> {
    let mut s = splitmix64(0x5eed ^ (u64::from(layer) << 40) ^ u64::from(pos));
    let mut out: Vec<u16> = Vec::with_capacity(k);
    while out.len() < k.min(n as usize) {
        s = splitmix64(s);
        let u = (s >> 11) as f64 / (1u64 << 53) as f64;
        let e = ((u * u) * f64::from(n)) as u16;
        if !out.contains(&e) {
            out.push(e);
        }
    }
    out
}

#[derive(Copy, Clone, Debug, PartialEq)]
enum Predictor {
    /// No `predict` at all (the trait default).
    None,
    /// Exactly the target's routing.
    Perfect,
    /// The target's routing for a different position (mostly wrong).
    Wrong,
}

type Rig = Engine<ManualClock, MemFlash, ScriptBackend>;

fn rig(predictor: Predictor, cfg: PredictConfig, overlap: bool, budget_experts: u64) -> Rig {
    let layers: Vec<u32> = (0..N_LAYERS).collect();
    let (layout, shards) = synthetic_model(N_LAYERS, &layers, N_EXPERT, K, &PROJ, 11).unwrap();
    let clock = ManualClock::new();
    let store = SlotStore::new();
    let flash = MemFlash::new(shards.clone(), 2, clock.clone())
        .with_timing(MemTiming {
            latency: Nanos(2_000),
            bytes_per_us: 8,
            align_bytes: 16,
        })
        .with_store(store.clone());
    let costs = ScriptCosts {
        dense: Nanos(1_000),
        expert: Nanos(1_500),
        ..Default::default()
    };
    let mut backend =
        ScriptBackend::new(layout.clone(), shards, K as usize, 1, clock.clone(), costs)
            .with_store(store)
            .with_routes(Box::new(|layer: LayerId, pos, k, n| {
                route_of(layer.moe, pos, k, n)
            }));
    match predictor {
        Predictor::None => {}
        Predictor::Perfect => {
            backend = backend.with_predict(Box::new(|_from, target: LayerId, pos, k, n| {
                Some(route_of(target.moe, pos, k, n))
            }))
        }
        Predictor::Wrong => {
            backend = backend.with_predict(Box::new(|_from, target: LayerId, pos, k, n| {
                Some(route_of(target.moe, pos + 7919, k, n))
            }))
        }
    }
    let budget = budget_experts * layout.max_expert_bytes();
    let cache = ExpertCache::new(&layout, budget, K, Box::new(Lru::new())).unwrap();
    let config = StreamConfig {
        overlap,
        ..Default::default()
    };
    let mut e = Engine::new(clock, flash, backend, layout, cache, config).unwrap();
    e.set_predictors(cfg);
    e
}

struct Ran {
    states: Vec<Vec<u64>>,
    stats: Vec<StepStats>,
    sink: RecordingSink,
    predictions: Vec<(LayerId, LayerId)>,
}

fn run(mut e: Rig, n_decode: u32) -> Ran {
    let mut sink = RecordingSink::default();
    let mut states = Vec::new();
    let mut stats = Vec::new();
    for t in 0..=n_decode {
        let (tokens, positions, phase): (Vec<u32>, Vec<u32>, Phase) = if t == 0 {
            (
                (0..N_PROMPT).map(|i| 100 + i).collect(),
                (0..N_PROMPT).collect(),
                Phase::Prefill,
            )
        } else {
            let pos = N_PROMPT + t - 1;
            (vec![1000 + pos], vec![pos], Phase::Decode)
        };
        let s = e
            .step(
                &StepInput {
                    turn: 0,
                    phase,
                    tokens: &tokens,
                    positions: &positions,
                },
                &mut sink as &mut dyn RecordSink,
            )
            .unwrap();
        e.cache().audit().unwrap();
        assert_eq!(e.cache().pinned_bytes(), 0, "nothing pinned between steps");
        assert_eq!(e.flash().in_flight(), 0, "nothing in flight between steps");
        states.push(e.backend().state().to_vec());
        stats.push(s);
    }
    Ran {
        states,
        stats,
        sink,
        predictions: e.backend().predictions.clone(),
    }
}

fn total(ran: &Ran, f: impl Fn(&StepStats) -> u64) -> u64 {
    ran.stats.iter().map(f).sum()
}

fn log_cfg() -> PredictConfig {
    PredictConfig {
        log: true,
        ..Default::default()
    }
}

#[test]
fn the_probe_grades_a_perfect_predictor_at_100_and_changes_nothing() {
    let n_decode = 12u64;
    let base = run(
        rig(Predictor::None, PredictConfig::default(), false, 10),
        12,
    );
    let ran = run(rig(Predictor::Perfect, log_cfg(), false, 10), 12);
    assert_eq!(ran.states, base.states, "the probe changed the output");
    assert_eq!(
        total(&ran, |s| s.read_bytes),
        total(&base, |s| s.read_bytes)
    );
    assert_eq!(total(&ran, |s| s.hits), total(&base, |s| s.hits));
    assert!(ran.stats[0].predict.is_none(), "prefill is not probed");
    let mut p = bmoe_core::telemetry::summary::PredictReport::default();
    for s in &ran.stats[1..] {
        bmoe_core::predict::accumulate(&mut p, s.predict.as_ref().expect("decode probed"));
    }
    let layers = u64::from(N_LAYERS);
    let graded = n_decode - 1;
    assert_eq!(p.ctrl.rows, graded * layers);
    assert_eq!(p.ctrl.hit_slots, p.ctrl.slots);
    assert_eq!(p.stale.rows, graded * (layers - 1));
    assert_eq!(p.stale.hit_slots, p.stale.slots, "a perfect stale gate");
    assert_eq!(p.stale.exact_rows, p.stale.rows);
    assert_eq!(p.stale2.rows, graded * (layers - 2));
    assert_eq!(p.prev.rows, graded * layers);
    assert!(
        p.prev.hit_slots < p.prev.slots,
        "the script's routing moves"
    );
    // The first token at every layer, and layer 0 of every later token.
    assert_eq!(p.unscored, layers + graded);
    assert_eq!(p.by_layer.len(), N_LAYERS as usize);
    assert_eq!(p.by_layer[0][0].rows, 0, "layer 0 has no stale score");
    assert_eq!(p.by_layer[1][0].rows, graded);
    // Horizons 0, 1, 2 from every layer where the target exists; none on the first token.
    let mut expect = Vec::new();
    for _ in 0..graded {
        for l in 0..N_LAYERS as u16 {
            for h in 0..=2u16 {
                if l + h < N_LAYERS as u16 {
                    expect.push((l, l + h));
                }
            }
        }
    }
    let got: Vec<(u16, u16)> = ran
        .predictions
        .iter()
        .map(|(f, t)| (f.moe, t.moe))
        .collect();
    assert_eq!(got, expect);

    let wrong = run(rig(Predictor::Wrong, log_cfg(), false, 10), 12);
    let mut w = bmoe_core::telemetry::summary::PredictReport::default();
    for s in &wrong.stats[1..] {
        bmoe_core::predict::accumulate(&mut w, s.predict.as_ref().unwrap());
    }
    assert!(
        w.stale.hit_slots < w.stale.slots,
        "a wrong predictor scores below 100%"
    );
}

#[test]
fn predicted_prefetch_never_changes_the_output_and_right_guesses_are_used() {
    for overlap in [false, true] {
        for budget in [10u64, 24] {
            let base = run(
                rig(Predictor::None, PredictConfig::default(), overlap, budget),
                16,
            );
            for spec_max in [0u32, 2, 8] {
                for predictor in [Predictor::Perfect, Predictor::Wrong] {
                    let cfg = PredictConfig {
                        prefetch: true,
                        spec_max,
                        ..Default::default()
                    };
                    let ran = run(rig(predictor, cfg, overlap, budget), 16);
                    let what =
                        format!("{predictor:?} spec {spec_max} budget {budget} overlap {overlap}");
                    assert_eq!(ran.states, base.states, "{what}");
                    if spec_max == 0 {
                        assert_eq!(total(&ran, |s| s.spec_issued), 0, "{what}: retention only");
                    }
                    if spec_max > 0 && predictor == Predictor::Perfect {
                        assert!(total(&ran, |s| s.spec_useful) > 0, "{what}: nothing used");
                        assert!(total(&ran, |s| s.spec_experts) > 0, "{what}");
                    }
                }
            }
        }
    }
}

#[test]
fn sync_speculation_completes_every_read_where_it_is_issued() {
    for overlap in [false, true] {
        let base = run(
            rig(Predictor::None, PredictConfig::default(), overlap, 10),
            16,
        );
        let cfg = PredictConfig {
            prefetch: true,
            spec_max: 8,
            sync: true,
            ..Default::default()
        };
        let ran = run(rig(Predictor::Perfect, cfg, overlap, 10), 16);
        assert_eq!(ran.states, base.states);
        assert!(total(&ran, |s| s.spec_issued) > 0);
        // Waited for inline: nothing left to cancel or give up, every admission complete.
        assert_eq!(total(&ran, |s| s.spec_cancelled), 0);
        assert_eq!(
            total(&ran, |s| s.spec_experts),
            total(&ran, |s| s.spec_issued)
        );
    }
}

#[test]
fn the_route_trace_carries_the_predictions() {
    let ran = run(rig(Predictor::Perfect, log_cfg(), false, 10), 6);
    let first_decode = i64::from(N_PROMPT);
    for r in &ran.sink.routes {
        let later = r.phase == Phase::Decode && r.step > first_decode;
        let h1 = r.preds[0];
        if later && r.layer >= 1 {
            assert_eq!(h1.map(|(e, _)| u32::from(e)), Some(r.expert), "{r:?}");
            assert!(h1.is_some_and(|(_, w)| w > 0.0));
        } else {
            assert_eq!(h1, None, "{r:?}");
        }
        let h2 = r.preds[1];
        assert_eq!(h2.is_some(), later && r.layer >= 2, "{r:?}");
        assert!(r.preds[2..].iter().all(Option::is_none));
        assert_eq!(r.router_expert, None);
    }
}

#[test]
fn route_ahead_without_router_probabilities_passes_through() {
    let n_decode = 8u64;
    let base = run(rig(Predictor::None, PredictConfig::default(), false, 10), 8);
    let cfg = PredictConfig {
        route_ahead: 1,
        ..Default::default()
    };
    let ran = run(rig(Predictor::Perfect, cfg, false, 10), 8);
    assert_eq!(ran.states, base.states);
    assert_eq!(total(&ran, |s| s.ra_committed), 0);
    assert_eq!(
        total(&ran, |s| s.ra_passthrough),
        n_decode * u64::from(N_LAYERS)
    );
    // Still predicted one layer ahead (the early reads use it), and timed.
    assert!(ran.predictions.iter().all(|(f, t)| t.moe == f.moe + 1));
    assert_eq!(
        total(&ran, |s| s.ra_gemv_jobs),
        ran.predictions.len() as u64
    );
}

#[test]
fn route_ahead_early_reads_are_never_cancelled() {
    for overlap in [false, true] {
        let base = run(
            rig(Predictor::None, PredictConfig::default(), overlap, 10),
            16,
        );
        for predictor in [Predictor::Perfect, Predictor::Wrong] {
            let cfg = PredictConfig {
                route_ahead: 1,
                ..Default::default()
            };
            let ran = run(rig(predictor, cfg, overlap, 10), 16);
            let what = format!("{predictor:?} overlap {overlap}");
            // The scripted router gives no probabilities: every routing passes through, so the
            // output is the baseline's and only the early reads differ.
            assert_eq!(ran.states, base.states, "{what}");
            assert!(total(&ran, |s| s.spec_issued) > 0, "{what}: no early reads");
            assert_eq!(total(&ran, |s| s.spec_cancelled), 0, "{what}: cancelled");
            if predictor == Predictor::Perfect {
                assert_eq!(
                    total(&ran, |s| s.spec_dropped),
                    0,
                    "{what}: a right guess is never given up"
                );
                assert!(total(&ran, |s| s.spec_useful) > 0, "{what}");
            }
        }
    }
}
