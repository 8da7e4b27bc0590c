//! Randomised simulation testing of the core (`bmoe-sim fuzz --seed N [--seeds M]`).
//!
//! One seed picks everything: a synthetic route trace (layers, experts, top-k, extent sizes,
//! prompt and decode lengths, a skewed routing written by our writer and read back by our
//! reader), a configuration (budget in bytes from "one layer's demand" up, lanes, serial or
//! overlap, eviction policy, prefetch, cache-aware dropping, a top-k override, the read split)
//! and a fault schedule (none, transient EIO / short / spikes, persistent EIO, a stuck lane).
//! The real core then replays it on the simulator, and after every step the driver checks:
//! - the cache's own audit passes, it holds no more than its budget, and (without prefetch,
//!   whose speculative entries may stay pinned) nothing stays pinned between steps;
//! - the step's read bytes equal the io trace's rows of that step, and (without prefetch)
//!   every expert projection read in a step is covered exactly once — each miss read once;
//! - after the run: the same seed replayed again gives the same CSV, io trace and counters
//!   (determinism); a run without faults never fails; a failed run failed on a reported flash
//!   fault; a run whose transient faults were all retried has the counts and bytes of the
//!   fault-free run of the same configuration (without prefetch, which timing steers).
//!
//! A failing seed is the bug report: `bmoe-sim fuzz --seed N` reproduces it.

use crate::error::SimError;
use crate::plan::{layout_from_preamble, ReplayPlan};
use crate::profile::{DeviceProfile, DEFAULT_PROFILE};
use crate::replay::{self, ReplayOutputs, ReplaySetup};
use bmoe_core::config::{EvictionPolicy as PolicyName, RunConfig};
use bmoe_core::faults::FaultPlan;
use bmoe_core::records::{IoRecord, Phase, RecordSink, RouteRecord};
use bmoe_core::step::ReadSplit;
use bmoe_core::telemetry::io_trace::IoTraceWriter;
use bmoe_core::telemetry::route_trace::{
    PredColumns, ProjExtent, RoutePreamble, RouteTrace, RouteTraceWriter, TraceLayer,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

/// What one seed chose, for the report line.
#[derive(Clone, Debug)]
pub struct Case {
    pub seed: u64,
    pub summary: String,
    /// The replay failed on a (reported) injected fault.
    pub failed_on_fault: bool,
    /// Steps checked.
    pub steps: u64,
}

fn synthetic_trace(rng: &mut ChaCha8Rng) -> Result<RouteTrace, String> {
    let n_layer = rng.gen_range(1..=4u32);
    let n_expert = [4u32, 8, 16, 32][rng.gen_range(0..4)];
    let k = rng.gen_range(1..=3u32.min(n_expert - 1));
    let mut offset = 4096u64;
    let layers: Vec<TraceLayer> = (0..n_layer)
        .map(|layer| {
            let proj: Vec<ProjExtent> = (0..3)
                .map(|_| {
                    let stride =
                        4096 * rng.gen_range(1..=8u64) + [0, 512, 1000][rng.gen_range(0..3)];
                    let p = ProjExtent {
                        shard: 0,
                        offset,
                        stride,
                    };
                    offset += stride * u64::from(n_expert);
                    p
                })
                .collect();
            TraceLayer {
                layer,
                expert_bytes: proj.iter().map(|p| p.stride).sum(),
                dense_bytes: 1000,
                proj,
            }
        })
        .collect();
    let pre = RoutePreamble {
        model: "fuzz".into(),
        arch: "qwen3moe".into(),
        n_layer,
        n_expert,
        n_expert_used: k,
        gating: bmoe_core::Gating::default(),
        layers: layers.clone(),
        notes: Vec::new(),
        extra: Vec::new(),
    };
    let n_prompt = rng.gen_range(1..=6i64);
    let n_decode = rng.gen_range(2..=16i64);
    let skew: f64 = rng.gen_range(1.0..3.0);
    let mut w = RouteTraceWriter::with_predictions(Vec::new(), &pre, PredColumns::NONE)
        .map_err(|e| e.to_string())?;
    for step in 0..n_prompt + n_decode {
        let phase = if step < n_prompt {
            Phase::Prefill
        } else {
            Phase::Decode
        };
        for (li, l) in layers.iter().enumerate() {
            let mut ids: Vec<u32> = Vec::new();
            while ids.len() < k as usize {
                let u: f64 = rng.gen();
                let e = (u.powf(skew) * f64::from(n_expert)) as u32;
                if !ids.contains(&e) {
                    ids.push(e.min(n_expert - 1));
                    ids.dedup();
                }
            }
            let raw: Vec<f32> = (0..ids.len()).map(|j| 1.0 / (j as f32 + 1.5)).collect();
            let sum: f32 = raw.iter().sum();
            for (slot, &e) in ids.iter().enumerate() {
                w.write(&RouteRecord {
                    turn: 0,
                    phase,
                    step,
                    layer: li as u32,
                    slot: slot as u32,
                    expert: e,
                    weight: raw[slot] / sum,
                    residency: 0,
                    expert_bytes: l.expert_bytes,
                    dropped: false,
                    preds: Default::default(),
                    row: 0,
                    router_expert: None,
                })
                .map_err(|e| e.to_string())?;
            }
        }
    }
    let text =
        String::from_utf8(w.finish().map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
    RouteTrace::parse(&text).map_err(|e| format!("our own synthetic trace is refused: {e}"))
}

/// A sink both the replay and the step checker see.
#[derive(Clone, Default)]
struct SharedIo(Rc<RefCell<Vec<IoRecord>>>);

impl RecordSink for SharedIo {
    fn wants_io(&self) -> bool {
        true
    }
    fn io(&mut self, r: &IoRecord) {
        self.0.borrow_mut().push(r.clone());
    }
}

struct Outcome {
    result: Result<replay::ReplayResult, String>,
    csv: Vec<u8>,
    io: Vec<IoRecord>,
    steps: u64,
}

fn replay_once(
    trace: &Arc<RouteTrace>,
    cfg: &RunConfig,
    budget: u64,
    seed: u64,
) -> Result<Outcome, String> {
    let layout = layout_from_preamble(&trace.preamble).map_err(|e| e.to_string())?;
    let plan = Arc::new(ReplayPlan::new(trace).map_err(|e| e.to_string())?);
    let profile = DeviceProfile::load(DEFAULT_PROFILE).map_err(|e| e.to_string())?;
    let policy = bmoe_core::policy::by_name(cfg.eviction.name()).ok_or("no such policy")?;
    let io = SharedIo::default();
    let mut io_sink = io.clone();
    let mut csv = Vec::new();
    let mut seen = 0usize;
    let mut steps = 0u64;
    let strides: Vec<Vec<u64>> = layout
        .layers()
        .iter()
        .map(|l| l.projections.iter().map(|p| p.stride_bytes).collect())
        .collect();
    let prefetch = cfg.prefetch > 0;
    let io_check = io.clone();
    let mut check = |st: &bmoe_core::StepStats, cache: &bmoe_core::ExpertCache| {
        steps += 1;
        cache.audit().map_err(|e| format!("cache audit: {e}"))?;
        if !cache.is_off() && cache.resident_bytes() > cache.budget_bytes() {
            return Err(format!(
                "cache holds {} bytes over its budget of {}",
                cache.resident_bytes(),
                cache.budget_bytes()
            ));
        }
        if !prefetch && cache.pinned_bytes() > 0 {
            return Err(format!(
                "{} bytes stay pinned after a step",
                cache.pinned_bytes()
            ));
        }
        let all = io_check.0.borrow();
        let new = &all[seen..];
        seen = all.len();
        let bytes: u64 = new.iter().map(|r| r.read_bytes).sum();
        if bytes != st.read_bytes {
            return Err(format!(
                "the step counts {} read bytes, its io trace rows {bytes}",
                st.read_bytes
            ));
        }
        if !prefetch {
            let mut cover: HashMap<(u32, u32, u8), u64> = HashMap::new();
            for r in new {
                *cover.entry((r.layer, r.expert, r.proj)).or_default() += r.req_bytes;
            }
            let mut keys: Vec<_> = cover.into_iter().collect();
            keys.sort();
            for ((layer, expert, proj), got) in keys {
                let want = strides
                    .get(layer as usize)
                    .and_then(|s| s.get(proj as usize))
                    .copied()
                    .unwrap_or(0);
                if got != want {
                    return Err(format!(
                        "layer {layer} expert {expert} projection {proj}: {got} bytes read in one step, its extent is {want} (each miss is read exactly once)"
                    ));
                }
            }
        }
        Ok(())
    };
    let result = replay::run(
        ReplaySetup {
            trace: trace.clone(),
            plan,
            layout: &layout,
            cfg,
            budget_bytes: budget,
            policy,
            profile: &profile,
            seed,
        },
        ReplayOutputs {
            csv: Some(&mut csv),
            io: Some(&mut io_sink),
            on_step: Some(&mut check),
            ..ReplayOutputs::default()
        },
    )
    .map_err(|e| e.to_string());
    let io = io.0.borrow().clone();
    Ok(Outcome {
        result,
        csv,
        io,
        steps,
    })
}

fn io_text(records: &[IoRecord]) -> Vec<u8> {
    let mut w = IoTraceWriter::new(Vec::new()).expect("in memory");
    for r in records {
        let _ = w.write(r);
    }
    w.finish().unwrap_or_default()
}

/// Run one seed. `Err` is a broken invariant, with everything needed to reproduce it.
pub fn run_seed(seed: u64) -> Result<Case, String> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // A draw may route every token alike (few experts, strong skew), which the reader
    // rightly refuses as no real routing: draw again, from the same stream.
    let mut drawn = synthetic_trace(&mut rng);
    for _ in 0..16 {
        match &drawn {
            Err(e) if e.contains("every token routes the same") => {
                drawn = synthetic_trace(&mut rng)
            }
            _ => break,
        }
    }
    let trace = Arc::new(drawn.map_err(|e| format!("seed {seed}: {e}"))?);
    let layout = layout_from_preamble(&trace.preamble).map_err(|e| e.to_string())?;
    let k = trace.preamble.n_expert_used as u16;
    let mut cfg = RunConfig {
        moe_stream: true,
        ..RunConfig::default()
    };
    cfg.model = trace.preamble.model.clone();
    cfg.arch = trace.preamble.arch.clone();
    cfg.n_layer = trace.preamble.n_layer;
    cfg.n_expert = trace.preamble.n_expert;
    cfg.n_expert_used = u32::from(k);
    cfg.io_threads = rng.gen_range(1..=8);
    cfg.overlap = rng.gen_bool(0.5);
    let cache_on = rng.gen_bool(0.75);
    let demand = layout.layer_demand_bytes(k);
    let total = layout.total_expert_bytes();
    let budget = if cache_on {
        rng.gen_range(demand..=total + total / 4)
    } else {
        0
    };
    if cache_on {
        cfg.cache_mb = 1500;
        cfg.force_cache = true;
        let all = PolicyName::all();
        cfg.eviction = all[rng.gen_range(0..all.len())];
        if rng.gen_bool(0.3) {
            cfg.prefetch = rng.gen_range(1..=2);
        }
        if rng.gen_bool(0.2) {
            cfg.drop_cold_frac = rng.gen_range(0.05..0.6);
        }
    }
    if rng.gen_bool(0.2) && k > 1 {
        cfg.n_expert_used_override = rng.gen_range(1..u32::from(k));
        cfg.n_expert_used = cfg.n_expert_used_override;
    }
    cfg.read_split = [
        ReadSplit::Auto,
        ReadSplit::Whole,
        ReadSplit::Lanes,
        ReadSplit::MaxBytes(4096 * rng.gen_range(1..=4)),
    ][rng.gen_range(0..4)];
    let fault_kind = rng.gen_range(0..6);
    let fseed: u64 = rng.gen();
    cfg.inject_faults = match fault_kind {
        0 | 1 => None,
        2 => Some(FaultPlan {
            seed: fseed,
            eio: 0.1,
            short: 0.1,
            spike: 0.1,
            spike_ns: 2_000_000,
            ..FaultPlan::default()
        }),
        3 => Some(FaultPlan {
            seed: fseed,
            spike: 0.3,
            spike_ns: 5_000_000,
            ..FaultPlan::default()
        }),
        4 => Some(FaultPlan {
            seed: fseed,
            eio: 0.05,
            persistent: true,
            ..FaultPlan::default()
        }),
        _ => Some(FaultPlan {
            stuck: Some((rng.gen_range(0..cfg.io_threads), rng.gen_range(0..40))),
            ..FaultPlan::default()
        }),
    };
    cfg.read_timeout_ms = 500;
    let summary = format!(
        "layers={} experts={} k={} steps={} budget={budget} lanes={} overlap={} policy={} prefetch={} drop={:.2} topk={} split={} faults={}",
        trace.preamble.n_layer,
        trace.preamble.n_expert,
        k,
        trace.steps().count(),
        cfg.io_threads,
        cfg.overlap,
        cfg.eviction.name(),
        cfg.prefetch,
        cfg.drop_cold_frac,
        cfg.n_expert_used_override,
        cfg.read_split.name(),
        cfg.inject_faults
            .as_ref()
            .map_or("none".to_string(), |p| format!("{p:?}"))
    );
    let fail = |what: String| format!("seed {seed} ({summary}): {what}");
    cfg.validate()
        .map_err(|e| fail(format!("config refused: {e}")))?;
    cfg.validate_model()
        .map_err(|e| fail(format!("config refused: {e}")))?;

    let a = replay_once(&trace, &cfg, budget, seed).map_err(&fail)?;
    let b = replay_once(&trace, &cfg, budget, seed).map_err(&fail)?;
    if a.csv != b.csv || io_text(&a.io) != io_text(&b.io) || a.result != b.result {
        return Err(fail(
            "two replays of the same seed differ (determinism)".into(),
        ));
    }
    let failed_on_fault = match &a.result {
        Ok(_) => false,
        Err(e) if e.contains("invariant") => return Err(fail(e.clone())),
        Err(e) => {
            let reported = e.contains("injected") || e.contains("did not complete within");
            if cfg.inject_faults.is_none() || !reported {
                return Err(fail(format!(
                    "the replay failed without a reported fault: {e}"
                )));
            }
            true
        }
    };
    // Transient faults only (retried) and no prefetch: the counts of the fault-free run.
    let transient = cfg
        .inject_faults
        .as_ref()
        .is_some_and(|p| !p.persistent && p.stuck.is_none());
    if transient && cfg.prefetch == 0 {
        let clean = RunConfig {
            inject_faults: None,
            ..cfg.clone()
        };
        let c = replay_once(&trace, &clean, budget, seed).map_err(&fail)?;
        match (&a.result, &c.result) {
            (Ok(x), Ok(y)) if x.cache == y.cache && x.read_bytes == y.read_bytes => {}
            (x, y) => {
                return Err(fail(format!(
                    "retried transient faults changed the run: {:?} vs fault-free {:?}",
                    x.as_ref().map(|r| (r.cache, r.read_bytes)),
                    y.as_ref().map(|r| (r.cache, r.read_bytes))
                )))
            }
        }
    }
    Ok(Case {
        seed,
        summary,
        failed_on_fault,
        steps: a.steps,
    })
}

/// Run seeds `first..first + count`, calling `progress(done)` now and then; the first broken
/// invariant is the error.
pub fn run_seeds(
    first: u64,
    count: u64,
    mut progress: impl FnMut(u64, &Case),
) -> Result<(u64, u64, u64), SimError> {
    let (mut steps, mut faulted) = (0u64, 0u64);
    for i in 0..count {
        let case = run_seed(first.wrapping_add(i)).map_err(|e| SimError::invalid("fuzz", e))?;
        steps += case.steps;
        faulted += u64::from(case.failed_on_fault);
        progress(i + 1, &case);
    }
    Ok((count, steps, faulted))
}

#[cfg(test)]
mod tests {
    /// CI's share: a few hundred seeds on every change (scripts/sim-fuzz.sh runs millions).
    #[test]
    fn three_hundred_seeds_hold_every_invariant() {
        let (n, steps, faulted) =
            super::run_seeds(0, 300, |_, _| {}).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(n, 300);
        assert!(steps > 300, "{steps} steps");
        assert!(
            faulted > 0 && faulted < 300,
            "{faulted} runs stopped by faults"
        );
    }

    #[test]
    fn a_seed_is_reproducible() {
        let a = super::run_seed(12345).expect("seed 12345");
        let b = super::run_seed(12345).expect("seed 12345");
        assert_eq!((a.summary, a.steps), (b.summary, b.steps));
    }
}
