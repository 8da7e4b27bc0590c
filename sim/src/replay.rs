//! The full-timing replay: a route trace run through `bmoe_core::Engine` on the virtual clock,
//! the flash model and the trace backend, reported through the core's telemetry exactly as
//! `bmoe-cli` reports a measured run (same ledger, same CSV writer, same report lines).
//!
//! Each turn of the trace is one generation: its prefill (one batched step), then its decode
//! steps, with a modelled loop overhead before every decode step and after the last. The
//! cache persists across turns — a session keeps it warm — while the per-generation figures
//! (the CSV `# summary` trailer, the ledger's hit rate) restart with each turn, as the core's
//! `Ledger` defines them. The end-of-run report covers the whole replay.

use crate::clock::VirtualClock;
use crate::compute::TraceBackend;
use crate::error::SimError;
use crate::flash::FlashModel;
use bmoe_core::faults::{FaultCounts, RetryFlash, READ_RETRIES};

/// The replay's device: the flash model behind the same retry the engine uses.
type SimFlash = RetryFlash<FlashModel>;
use crate::plan::ReplayPlan;
use crate::profile::DeviceProfile;
use bmoe_core::config::RunConfig;
use bmoe_core::ledger::{Ledger, MemPicture};
use bmoe_core::policy::EvictionPolicy;
use bmoe_core::records::{Phase, RecordSink};
use bmoe_core::telemetry::route_trace::RouteTrace;
use bmoe_core::telemetry::run::RunTelemetry;
use bmoe_core::telemetry::summary::{
    PredictReport, PredictorStats, RunCounters, RunSummary, TokenTotals,
};
use bmoe_core::{
    CacheCounters, Clock, Engine, ExpertCache, ExpertLayout, Nanos, StepInput, StepStats,
    StreamConfig,
};
use std::io::Write;
use std::sync::Arc;

/// Everything a replay needs besides its outputs.
pub struct ReplaySetup<'a> {
    pub trace: Arc<RouteTrace>,
    pub plan: Arc<ReplayPlan>,
    pub layout: &'a ExpertLayout,
    /// The resolved configuration (model facts filled, `validate` passed).
    pub cfg: &'a RunConfig,
    /// The cache budget in bytes (0 = off). The CLI passes `cache_budget_mb` × MiB; sweeps
    /// may pass any byte count.
    pub budget_bytes: u64,
    pub policy: Box<dyn EvictionPolicy>,
    pub profile: &'a DeviceProfile,
    /// Seeds the flash and compute jitter streams.
    pub seed: u64,
}

/// Where a replay writes. Every output is optional.
#[derive(Default)]
pub struct ReplayOutputs<'a> {
    /// `--csv`: the `# bmoe_metrics v2` file.
    pub csv: Option<&'a mut dyn Write>,
    /// `--progress`: `BMOE_LOAD` / `BMOE_PROGRESS` lines.
    pub progress: Option<&'a mut dyn Write>,
    /// `--route-trace` / `--io-trace` sinks.
    pub route: Option<&'a mut dyn RecordSink>,
    pub io: Option<&'a mut dyn RecordSink>,
    /// Every decode step's `StepStats`, in order (for calibration).
    pub decode_stats: Option<&'a mut Vec<StepStats>>,
    /// Called after every step (prefill and decode) with the step's stats and the cache, to
    /// check invariants (`bmoe-sim fuzz`); an `Err` stops the replay.
    pub on_step: Option<&'a mut StepObserver<'a>>,
}

/// See [`ReplayOutputs::on_step`].
pub type StepObserver<'a> =
    dyn FnMut(&StepStats, &bmoe_core::ExpertCache) -> Result<(), String> + 'a;

/// What a replay did and cost.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayResult {
    /// The cache's counters over the whole replay (prefill included).
    pub cache: CacheCounters,
    /// Σ read bytes (aligned windows) over every step.
    pub read_bytes: u64,
    /// Decode steps replayed.
    pub decode_steps: u64,
    /// Σ decode wall time.
    pub decode_wall: Nanos,
    /// The whole replay as one summary (what the report prints).
    pub summary: RunSummary,
    /// One summary per turn (what each CSV `# summary` trailer says).
    pub turns: Vec<RunSummary>,
    /// Virtual time at the end.
    pub end: Nanos,
    /// Reads retried after an (injected) EIO or short read.
    pub read_retries: u64,
    /// Faults `--inject-faults` dealt.
    pub faults: FaultCounts,
}

impl ReplayResult {
    /// Decode tokens per second of modelled decode time.
    pub fn tokens_per_s(&self) -> f64 {
        self.summary.tokens_per_s()
    }

    /// Hit fraction of every lookup (prefill included), 0 with none.
    pub fn hit_rate(&self) -> f64 {
        let n = self.cache.hits + self.cache.misses;
        if n == 0 {
            0.0
        } else {
            self.cache.hits as f64 / n as f64
        }
    }
}

fn add_totals(into: &mut TokenTotals, t: &TokenTotals) {
    into.tokens += t.tokens;
    into.wall_ms += t.wall_ms;
    into.io_ms += t.io_ms;
    into.compute_ms += t.compute_ms;
    into.stall_ms += t.stall_ms;
    into.mgmt_ms += t.mgmt_ms;
    into.read_bytes += t.read_bytes;
    into.majflt += t.majflt;
    into.cpu_ms += t.cpu_ms;
    into.loop_overhead_ms += t.loop_overhead_ms;
    into.mtp_draft_ms += t.mtp_draft_ms;
    into.drain_ms += t.drain_ms;
    into.adopt_ms += t.adopt_ms;
    into.ra_issue_ms += t.ra_issue_ms;
    into.ra_wd_ms += t.ra_wd_ms;
    if t.tokens > 0 {
        into.last_cache_hit_pct = t.last_cache_hit_pct;
    }
}

/// Sums of the per-turn counters: counts add, the demand figures are token-weighted (token
/// demand) or the widest (layer demand), and the cache's state is the last turn's.
fn add_counters(into: &mut RunCounters, c: &RunCounters, tokens_before: u64, tokens: u64) {
    let total = tokens_before + tokens;
    if total > 0 {
        into.token_demand_bytes = (into.token_demand_bytes * tokens_before as f64
            + c.token_demand_bytes * tokens as f64)
            / total as f64;
    }
    into.n_prompt += c.n_prompt;
    into.n_past = c.n_past;
    into.prefill_s += c.prefill_s;
    into.cache_resident_bytes = c.cache_resident_bytes;
    into.cache_budget_bytes = c.cache_budget_bytes;
    into.evictions += c.evictions;
    into.rereads += c.rereads;
    into.spec_read_bytes += c.spec_read_bytes;
    into.spec_experts += c.spec_experts;
    into.spec_useful += c.spec_useful;
    into.experts_reranked += c.experts_reranked;
    into.experts_substituted += c.experts_substituted;
    into.layer_demand_bytes = into.layer_demand_bytes.max(c.layer_demand_bytes);
    into.experts_routed += c.experts_routed;
    into.experts_dropped += c.experts_dropped;
    into.prefill.cpu_s += c.prefill.cpu_s;
    into.prefill.read_bytes += c.prefill.read_bytes;
    into.prefill.io_s += c.prefill.io_s;
    into.prefill.stall_s += c.prefill.stall_s;
    into.prefill.mgmt_s += c.prefill.mgmt_s;
    into.loop_overhead_tail_ms += c.loop_overhead_tail_ms;
    into.io_errors += c.io_errors;
    into.ra_committed += c.ra_committed;
    into.ra_passthrough += c.ra_passthrough;
    into.ra_slots += c.ra_slots;
    into.ra_agreed_slots += c.ra_agreed_slots;
    into.ra_gemv_ns += c.ra_gemv_ns;
    into.ra_gemv_jobs += c.ra_gemv_jobs;
    add_predict(&mut into.predict, c.predict.as_ref());
}

fn add_stats(into: &mut PredictorStats, s: &PredictorStats) {
    into.rows += s.rows;
    into.slots += s.slots;
    into.hit_slots += s.hit_slots;
    into.exact_rows += s.exact_rows;
}

/// The `--predict-log` probe over several turns: every score adds, per layer too.
fn add_predict(into: &mut Option<PredictReport>, r: Option<&PredictReport>) {
    let Some(r) = r else {
        return;
    };
    let into = into.get_or_insert_with(PredictReport::default);
    add_stats(&mut into.stale, &r.stale);
    add_stats(&mut into.stale2, &r.stale2);
    add_stats(&mut into.prev, &r.prev);
    add_stats(&mut into.ctrl, &r.ctrl);
    into.unscored += r.unscored;
    if into.by_layer.len() < r.by_layer.len() {
        into.by_layer
            .resize(r.by_layer.len(), [PredictorStats::default(); 3]);
    }
    for (mine, theirs) in into.by_layer.iter_mut().zip(&r.by_layer) {
        for (a, b) in mine.iter_mut().zip(theirs) {
            add_stats(a, b);
        }
    }
}

fn reborrow_w<'s>(o: &'s mut Option<&mut dyn Write>) -> Option<&'s mut dyn Write> {
    match o {
        Some(w) => Some(&mut **w),
        None => None,
    }
}

fn reborrow_s<'s>(o: &'s mut Option<&mut dyn RecordSink>) -> Option<&'s mut dyn RecordSink> {
    match o {
        Some(w) => Some(&mut **w),
        None => None,
    }
}

/// Run plan step `index` through the engine, feeding the trace sinks.
fn run_step(
    engine: &mut Engine<VirtualClock, SimFlash, TraceBackend>,
    plan: &ReplayPlan,
    index: usize,
    tokens: &mut Vec<u32>,
    route: &mut Option<&mut dyn RecordSink>,
    io: &mut Option<&mut dyn RecordSink>,
    route_ahead: Option<(&RouteTrace, usize)>,
) -> Result<StepStats, SimError> {
    let s = &plan.steps[index];
    engine
        .backend_mut()
        .set_step(index)
        .map_err(|e| SimError::invalid("replay plan", e.to_string()))?;
    tokens.clear();
    tokens.resize(s.positions.len(), 0);
    let mut tee = bmoe_core::telemetry::TraceTee {
        route: reborrow_s(route),
        io: reborrow_s(io),
    };
    let mut stats = engine.step(
        &StepInput {
            turn: s.turn,
            phase: s.phase,
            tokens,
            positions: &s.positions,
        },
        &mut tee,
    )?;
    // The routing fed is already the committed one, and the core cannot re-commit it without
    // the router's probabilities: route-ahead's counters come from the trace.
    if let Some((trace, k)) = route_ahead {
        if s.phase == Phase::Decode {
            let t = crate::predictions::route_ahead_tally(trace, s, k);
            stats.ra_committed = t.committed;
            stats.ra_passthrough = t.passthrough;
            stats.ra_slots = t.slots;
            stats.ra_agreed_slots = t.agreed_slots;
        }
    }
    Ok(stats)
}

/// Run the replay. The CSV preamble is written from `setup.cfg`, one `# summary` per turn.
pub fn run(setup: ReplaySetup<'_>, out: ReplayOutputs<'_>) -> Result<ReplayResult, SimError> {
    let ReplaySetup {
        trace,
        plan,
        layout,
        cfg,
        budget_bytes,
        policy,
        profile,
        seed,
    } = setup;
    let ReplayOutputs {
        mut csv,
        mut progress,
        mut route,
        mut io,
        mut decode_stats,
        mut on_step,
    } = out;
    let k = cfg.n_expert_used as u16;
    let clock = VirtualClock::new();
    let mut flash = FlashModel::new(
        clock.clone(),
        &profile.flash,
        cfg.io_threads,
        cfg.o_direct,
        seed,
    );
    flash.set_read_timeout_ms(cfg.read_timeout_ms);
    if let Some(plan) = &cfg.inject_faults {
        flash.set_faults(plan.clone());
    }
    // As in the engine: a read failing with EIO or short is retried before it is reported.
    let flash = RetryFlash::new(flash, READ_RETRIES);
    let backend = TraceBackend::new(
        clock.clone(),
        &profile.compute,
        layout,
        trace.clone(),
        plan.clone(),
        seed,
    );
    let cache = ExpertCache::new(layout, budget_bytes, k, policy)?;
    let mut engine = Engine::new(
        clock.clone(),
        flash,
        backend,
        layout.clone(),
        cache,
        StreamConfig {
            overlap: cfg.overlap,
            load_all: cfg.load_all,
            read_split: cfg.read_split,
            prefetch: cfg.prefetch,
        },
    )?;
    // The same router hooks, in the same order, as bmoe-cli installs (top-k override,
    // substitution, cache-aware dropping).
    for hook in bmoe_core::hooks::router_hooks(cfg, trace.preamble.n_expert_used, true) {
        engine.add_hook(hook);
    }
    engine.set_predictors(bmoe_core::PredictConfig::from_run_config(cfg));
    let ra = (cfg.route_ahead > 0).then_some((&*trace, usize::from(k)));

    let mut telemetry = RunTelemetry::new();
    if let Some(w) = reborrow_w(&mut csv) {
        telemetry
            .write_csv_preamble(cfg, w)
            .map_err(|e| SimError::io("--csv", e))?;
    }
    let layer_demand = layout.layer_demand_bytes(k);
    let mem = MemPicture::default();
    let mut whole = RunSummary::default();
    whole.counters.cache_hit_pct = f64::NAN;
    let mut turns = Vec::with_capacity(plan.turns.len());
    let mut read_bytes = 0u64;
    let mut decode_steps = 0u64;
    let mut decode_wall = Nanos::ZERO;
    let mut tokens: Vec<u32> = Vec::new();

    for turn in &plan.turns {
        telemetry.begin_generation();
        let n_decode = turn.decode.len() as u32;
        // The engine's first token comes from the prefill's logits, so a generation with a
        // prefill targets one token more than it decodes.
        let steps = n_decode + u32::from(turn.prefill.is_some());
        let mut ledger = Ledger::new(cfg.overlap, engine.cache().budget_bytes(), turn.turn, steps);
        let mut n_prompt = 0u64;
        let mut prefill_s = 0.0;
        if let Some(p) = turn.prefill {
            let st = run_step(&mut engine, &plan, p, &mut tokens, &mut route, &mut io, ra)?;
            if let Some(f) = on_step.as_deref_mut() {
                f(&st, engine.cache()).map_err(|e| SimError::invalid("invariant", e))?;
            }
            read_bytes += st.read_bytes;
            n_prompt = u64::from(st.tokens);
            prefill_s = st.wall.as_secs_f64();
            ledger.prefill(&st, &mem, &mem);
        }
        for index in turn.decode.clone() {
            let gap = engine.backend_mut().loop_gap();
            let st = run_step(
                &mut engine,
                &plan,
                index,
                &mut tokens,
                &mut route,
                &mut io,
                ra,
            )?;
            debug_assert_eq!(plan.steps[index].phase, Phase::Decode);
            if let Some(f) = on_step.as_deref_mut() {
                f(&st, engine.cache()).map_err(|e| SimError::invalid("invariant", e))?;
            }
            read_bytes += st.read_bytes;
            decode_steps += 1;
            decode_wall += st.wall;
            let rec = ledger.token(&st, &mem, gap.as_ms_f64());
            if let Some(v) = decode_stats.as_deref_mut() {
                v.push(st.clone());
            }
            telemetry
                .token(
                    &rec,
                    "",
                    "",
                    reborrow_w(&mut progress),
                    reborrow_w(&mut csv),
                )
                .map_err(|e| SimError::io("--csv/--progress", e))?;
        }
        let tail = engine.backend_mut().loop_gap();
        let counters = ledger.counters(
            engine.cache(),
            layer_demand,
            n_prompt,
            n_prompt + u64::from(n_decode),
            0.0,
            prefill_s,
            tail.as_ms_f64(),
        );
        let tokens_before = whole.totals.tokens;
        let summary = telemetry
            .finish(counters.clone(), reborrow_w(&mut csv))
            .map_err(|e| SimError::io("--csv", e))?;
        add_totals(&mut whole.totals, &summary.totals);
        add_counters(
            &mut whole.counters,
            &counters,
            tokens_before,
            summary.totals.tokens,
        );
        turns.push(summary);
    }
    let cache = engine.cache().counters();
    // The whole replay's hit rate: every lookup of the session's cache.
    whole.counters.cache_hit_pct = if engine.cache().is_off() {
        -1.0
    } else {
        let n = cache.hits + cache.misses;
        if n == 0 {
            0.0
        } else {
            100.0 * cache.hits as f64 / n as f64
        }
    };
    Ok(ReplayResult {
        cache,
        read_bytes,
        decode_steps,
        decode_wall,
        summary: whole,
        turns,
        end: clock.now(),
        read_retries: engine.flash().retried(),
        faults: engine.flash().inner().fault_counts(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(n: u64) -> PredictorStats {
        PredictorStats {
            rows: n,
            slots: 2 * n,
            hit_slots: n,
            exact_rows: n,
        }
    }

    #[test]
    fn turns_add_their_predictor_counters() {
        let turn = RunCounters {
            ra_committed: 3,
            ra_passthrough: 1,
            ra_slots: 12,
            ra_agreed_slots: 10,
            ra_gemv_ns: 7,
            ra_gemv_jobs: 3,
            predict: Some(PredictReport {
                stale: stats(4),
                stale2: stats(2),
                prev: stats(4),
                ctrl: stats(6),
                unscored: 5,
                by_layer: vec![[stats(1), stats(2), stats(3)]],
            }),
            ..RunCounters::default()
        };
        let mut whole = RunCounters::default();
        add_counters(&mut whole, &turn, 0, 10);
        add_counters(&mut whole, &turn, 10, 10);
        assert_eq!(
            (
                whole.ra_committed,
                whole.ra_passthrough,
                whole.ra_slots,
                whole.ra_agreed_slots,
                whole.ra_gemv_ns,
                whole.ra_gemv_jobs
            ),
            (6, 2, 24, 20, 14, 6)
        );
        let p = whole.predict.expect("probe");
        assert_eq!(p.stale, stats(8));
        assert_eq!(p.stale2, stats(4));
        assert_eq!(p.ctrl, stats(12));
        assert_eq!(p.unscored, 10);
        assert_eq!(p.by_layer, vec![[stats(2), stats(4), stats(6)]]);
        let mut none = RunCounters::default();
        add_counters(&mut none, &RunCounters::default(), 0, 1);
        assert_eq!(none.predict, None, "no probe, no report");
    }
}
