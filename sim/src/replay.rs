//! The full-timing replay: a route trace run through the core's generation loop
//! (`bmoe_core::Session` over `bmoe_core::Engine`) on the virtual clock, the flash model and
//! the trace backend, reported through the core's telemetry exactly as `bmoe-cli` reports a
//! measured run — the same loop, ledger, CSV writer and report lines; only the token source
//! differs (the recorded steps here, the sampler there).
//!
//! Each turn of the trace is one generation: its prefill (one batched step), then its decode
//! steps — one token each — with a modelled loop overhead before every decode step and after
//! the last. The cache persists across turns — a session keeps it warm — while the
//! per-generation figures (the CSV `# summary` trailer, the ledger's hit rate) restart with
//! each turn, as the core's `Ledger` defines them. The end-of-run report covers the whole
//! replay.

use crate::clock::VirtualClock;
use crate::compute::TraceBackend;
use crate::error::SimError;
use crate::flash::FlashModel;
use crate::plan::{PlanTurn, ReplayPlan};
use crate::profile::DeviceProfile;
use bmoe_core::config::RunConfig;
use bmoe_core::faults::{FaultCounts, RetryFlash, READ_RETRIES};
use bmoe_core::policy::EvictionPolicy;
use bmoe_core::records::{Phase, RecordSink};
use bmoe_core::telemetry::route_trace::{RouteTrace, TurnEnd};
use bmoe_core::telemetry::summary::RunSummary;
use bmoe_core::{
    CacheCounters, Clock, Engine, ExpertCache, ExpertLayout, GenerateError, Nanos, NoProbe,
    Outputs, Session, StepInput, StepStats, StreamConfig, TokenSource, TurnRequest,
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

/// The replay's token source: each turn's recorded steps, in plan order. Tokens are
/// placeholders (the trace records routings, not ids) fed at the recorded positions; the
/// modelled loop overhead is charged to the virtual clock before every decode step and once
/// after a turn's last.
struct Replayer<'a, 'o> {
    plan: &'a ReplayPlan,
    /// `--route-ahead` replays take their counters from the trace: (trace, k).
    route_ahead: Option<(&'a RouteTrace, usize)>,
    prefill: Option<usize>,
    /// Plan indices of the turn's decode steps not fed yet.
    decode: std::ops::Range<usize>,
    /// The decode step being fed.
    current: usize,
    read_bytes: u64,
    decode_steps: u64,
    decode_wall: Nanos,
    decode_stats: Option<&'a mut Vec<StepStats>>,
    on_step: Option<&'o mut StepObserver<'o>>,
    /// The trace numbers its steps (a speculative run's `group` column): a decode step may
    /// verify several positions.
    groups: bool,
    /// The turn's end line (the tokens it generated, whether it speculated), when the trace
    /// has one.
    turn_end: Option<TurnEnd>,
    /// Tokens this turn has given so far.
    emitted: u32,
}

impl Replayer<'_, '_> {
    fn start_turn(&mut self, turn: &PlanTurn, end: Option<TurnEnd>) {
        self.prefill = turn.prefill;
        self.decode = turn.decode.clone();
        self.turn_end = end;
        self.emitted = 0;
    }
}

impl TokenSource<TraceBackend> for Replayer<'_, '_> {
    type Error = SimError;

    fn before_step(
        &mut self,
        backend: &mut TraceBackend,
        input: &StepInput<'_>,
    ) -> Result<(), SimError> {
        let index = match input.phase {
            Phase::Prefill => self
                .prefill
                .ok_or_else(|| SimError::invalid("replay plan", "a prefill the turn lacks"))?,
            Phase::Decode => self.current,
        };
        backend
            .set_step(index)
            .map_err(|e| SimError::invalid("replay plan", e.to_string()))
    }

    fn after_step(
        &mut self,
        _backend: &TraceBackend,
        input: &StepInput<'_>,
        stats: &mut StepStats,
    ) -> Result<(), SimError> {
        self.read_bytes += stats.read_bytes;
        if input.phase == Phase::Decode {
            // The routing fed is already the committed one, and the core cannot re-commit it
            // without the router's probabilities: route-ahead's counters come from the trace.
            if let Some((trace, k)) = self.route_ahead {
                let t =
                    crate::predictions::route_ahead_tally(trace, &self.plan.steps[self.current], k);
                stats.ra_committed = t.committed;
                stats.ra_passthrough = t.passthrough;
                stats.ra_slots = t.slots;
                stats.ra_agreed_slots = t.agreed_slots;
            }
            self.decode_steps += 1;
            self.decode_wall += stats.wall;
            if let Some(v) = self.decode_stats.as_deref_mut() {
                v.push(stats.clone());
            }
        }
        Ok(())
    }

    fn observe(&mut self, cache: &ExpertCache, stats: &StepStats) -> Result<(), SimError> {
        match self.on_step.as_deref_mut() {
            Some(f) => f(stats, cache).map_err(|e| SimError::invalid("invariant", e)),
            None => Ok(()),
        }
    }

    fn next_token(
        &mut self,
        backend: &mut TraceBackend,
        _last: bool,
    ) -> Result<Option<u32>, SimError> {
        if self.decode.is_empty() {
            return Ok(None);
        }
        self.current = self.decode.start;
        self.decode.start += 1;
        debug_assert_eq!(self.plan.steps[self.current].phase, Phase::Decode);
        backend.loop_gap();
        self.emitted += 1;
        Ok(Some(0))
    }

    fn position(&self, _next_free: u32) -> u32 {
        self.plan.steps[self.current].positions[0]
    }

    fn replays_drafts(&self) -> bool {
        self.groups
    }

    fn verifies(&self) -> bool {
        self.groups
    }

    fn recorded_speculating(&self) -> Option<bool> {
        self.turn_end.map(|e| e.speculating)
    }

    /// The recorded step's positions after its first: placeholders the rows confirm as the
    /// recording did.
    fn recorded_draft(&mut self, out: &mut Vec<u32>) -> Option<()> {
        out.clear();
        let n = self.plan.steps[self.current].positions.len();
        out.resize(n.saturating_sub(1), 0);
        Some(())
    }

    /// Row `row` confirms its draft while the recording did: a group's confirmed positions are
    /// those before the position the turn's next decode step starts at; for the turn's last
    /// step, as many as the turn's end line says it generated (all of them without the line).
    /// The first rejection moves to that next step; in the last step it is the
    /// end-of-generation token the recording met there.
    fn next_token_at(
        &mut self,
        backend: &mut TraceBackend,
        row: u32,
        _last: bool,
    ) -> Result<Option<u32>, SimError> {
        let first = self.plan.steps[self.current].positions[0];
        let confirmed = match self.decode.clone().next() {
            Some(next) => self.plan.steps[next].positions[0].saturating_sub(first + 1),
            None => match self.turn_end {
                // The rows of the last step this turn still generates.
                Some(e) => row + e.tokens.saturating_sub(self.emitted),
                None => u32::MAX,
            },
        };
        if row < confirmed {
            self.emitted += 1;
            return Ok(Some(0));
        }
        if self.decode.is_empty() {
            return Ok(None);
        }
        self.current = self.decode.start;
        self.decode.start += 1;
        backend.loop_gap();
        Ok(Some(1))
    }

    fn finish(&mut self, backend: &mut TraceBackend) -> Result<(), SimError> {
        backend.loop_gap();
        Ok(())
    }
}

/// The tokens a recorded turn generated: one per decode step, and for a speculative run's
/// verify decode the positions it confirmed — all but those the turn's next step feeds again.
fn turn_tokens(plan: &ReplayPlan, turn: &PlanTurn) -> u32 {
    let steps = &plan.steps[turn.decode.clone()];
    let mut n = 0u32;
    for (i, s) in steps.iter().enumerate() {
        let width = s.positions.len() as u32;
        n += match steps.get(i + 1) {
            Some(next) => next.positions[0]
                .saturating_sub(s.positions[0])
                .clamp(1, width),
            None => width,
        };
    }
    n
}

/// A `GenerateError` as the simulator reports it: its own errors come back as they were.
fn sim_error(e: GenerateError) -> SimError {
    match e {
        GenerateError::Source(b) => match b.downcast::<SimError>() {
            Ok(e) => *e,
            Err(b) => SimError::invalid("replay", b.to_string()),
        },
        GenerateError::Io { what, source } => SimError::io(what, source),
        other => SimError::invalid("replay", other.to_string()),
    }
}

/// The engine a replay runs.
type SimEngine = Engine<VirtualClock, RetryFlash<crate::flash::SharedFlash>, TraceBackend>;

/// The replay's engine: the core's `Engine` over the flash model (retried as the engine
/// retries), the trace backend and a cache of `budget_bytes` under `policy`, with the router
/// hooks and predictors `cfg` asks for — what `bmoe-cli` builds over real flash and kernels.
#[allow(clippy::too_many_arguments)]
fn build_engine(
    trace: &Arc<RouteTrace>,
    plan: &Arc<ReplayPlan>,
    layout: &ExpertLayout,
    cfg: &RunConfig,
    budget_bytes: u64,
    policy: Box<dyn EvictionPolicy>,
    profile: &DeviceProfile,
    seed: u64,
) -> Result<(VirtualClock, SimEngine), SimError> {
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
    let meter = crate::compute::ReadMeter::new();
    flash.set_read_meter(meter.clone());
    if let Some(plan) = &cfg.inject_faults {
        flash.set_faults(plan.clone());
    }
    let flash = crate::flash::SharedFlash::new(flash);
    // As in the engine: a read failing with EIO or short is retried before it is reported.
    let retry = RetryFlash::new(flash.clone(), READ_RETRIES);
    let mut backend = TraceBackend::new(
        clock.clone(),
        &profile.compute,
        layout,
        trace.clone(),
        plan.clone(),
        seed,
    );
    backend.set_read_meter(meter);
    backend.set_flash(flash);
    let cache = ExpertCache::new(layout, budget_bytes, k, policy)?;
    let mut engine = Engine::new(
        clock.clone(),
        retry,
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
    // substitution, cache-aware dropping), weighing routings with the recorded gating.
    for hook in
        bmoe_core::hooks::router_hooks(cfg, trace.preamble.n_expert_used, trace.preamble.gating)
    {
        engine.add_hook(hook);
    }
    engine.set_predictors(bmoe_core::PredictConfig::from_run_config(cfg));
    Ok((clock, engine))
}

/// Run the replay through the core's generation loop (`bmoe_core::Session`), one turn per
/// recorded turn. The CSV preamble is written from `setup.cfg`, one `# summary` per turn.
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
        csv,
        progress,
        route,
        io,
        decode_stats,
        on_step,
    } = out;
    if trace.has_seq_column() {
        return Err(SimError::invalid(
            "replay",
            "the trace is a batched run's (its seq column: serve --parallel), whose steps hold \
             several requests' tokens: `bmoe-sim replay` replays it step by step; sweeps, \
             calibration and the fuzzer follow one generation at a time",
        ));
    }
    let k = cfg.n_expert_used as u16;
    let (clock, engine) = build_engine(
        &trace,
        &plan,
        layout,
        cfg,
        budget_bytes,
        policy,
        profile,
        seed,
    )?;
    let mut session = Session::new(engine, cfg.clone(), 0.0, Box::new(NoProbe));
    let mut source = Replayer {
        plan: &plan,
        route_ahead: (cfg.route_ahead > 0).then_some((&*trace, usize::from(k))),
        prefill: None,
        decode: 0..0,
        current: 0,
        read_bytes: 0,
        decode_steps: 0,
        decode_wall: Nanos::ZERO,
        decode_stats,
        on_step,
        groups: trace.has_group_column(),
        turn_end: None,
        emitted: 0,
    };
    let mut outputs = Outputs {
        progress,
        csv,
        route,
        io,
    };
    let mut turns = Vec::with_capacity(plan.turns.len());
    let mut prompt: Vec<u32> = Vec::new();
    for turn in &plan.turns {
        source.start_turn(turn, trace.turn_end(turn.turn));
        let positions: &[u32] = match turn.prefill {
            Some(p) => &plan.steps[p].positions,
            None => &[],
        };
        prompt.clear();
        prompt.resize(positions.len(), 0);
        session.set_next_turn(turn.turn);
        let outcome = session
            .generate(
                &TurnRequest {
                    prompt: &prompt,
                    positions,
                    n_predict: trace
                        .turn_end(turn.turn)
                        .map_or_else(|| turn_tokens(&plan, turn), |e| e.tokens),
                },
                &mut source,
                &mut outputs,
            )
            .map_err(sim_error)?;
        if let Some(e) = outcome.error {
            return Err(SimError::Step(e));
        }
        turns.push(outcome.summary);
    }
    Ok(ReplayResult {
        cache: session.engine().cache().counters(),
        read_bytes: source.read_bytes,
        decode_steps: source.decode_steps,
        decode_wall: source.decode_wall,
        summary: session.summary(),
        turns,
        end: clock.now(),
        read_retries: session.engine().flash().retried(),
        faults: session.engine().flash().inner().fault_counts(),
    })
}

/// What the replay of a batched run's trace (`serve --parallel`, the `seq` column) counted:
/// the cache's counters and, over the steps that fed no prompt, what `serve`'s
/// `bmoe_batch_*_total` metrics count (`bmoe_core::lanes::Lanes`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BatchedResult {
    /// The cache's counters over every step.
    pub cache: CacheCounters,
    /// Σ read bytes (aligned windows) over every step.
    pub read_bytes: u64,
    /// Shared steps replayed.
    pub steps: u64,
    /// Of them, steps that fed no prompt (every row a sequence's chosen token), and their
    /// rows, read bytes, routed bytes (each distinct expert of a layer once) and routings.
    pub decode_steps: u64,
    pub decode_rows: u64,
    pub decode_read_bytes: u64,
    pub decode_routed_bytes: u64,
    pub decode_routings: u64,
    /// Virtual time at the end.
    pub end: Nanos,
    /// Reads retried after an (injected) EIO or short read.
    pub read_retries: u64,
    /// Faults `--inject-faults` dealt.
    pub faults: FaultCounts,
}

/// Replay a batched run's trace (`RouteTrace::has_seq_column`): every recorded step, in
/// order, is one `Engine::step` over its rows — each sequence's tokens at their own
/// positions, in the engine's batch order — through the same cache, policy, hooks and
/// streamer as the engine, so the reads, hits and evictions are the engine's. There is no
/// generation loop to replay (the server's lanes choose the tokens), so no CSV and no
/// per-token report: only the route and io traces of `out` are written.
pub fn run_batched(
    setup: ReplaySetup<'_>,
    out: ReplayOutputs<'_>,
) -> Result<BatchedResult, SimError> {
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
    if !trace.has_seq_column() {
        return Err(SimError::invalid(
            "replay",
            "the trace has no seq column: it is not a batched run's (replay it turn by turn)",
        ));
    }
    let (clock, mut engine) = build_engine(
        &trace,
        &plan,
        layout,
        cfg,
        budget_bytes,
        policy,
        profile,
        seed,
    )?;
    let mut sink = bmoe_core::telemetry::TraceTee {
        route: out.route,
        io: out.io,
    };
    let mut on_step = out.on_step;
    let mut r = BatchedResult::default();
    let mut tokens: Vec<u32> = Vec::new();
    for (index, step) in plan.steps.iter().enumerate() {
        engine
            .backend_mut()
            .set_step(index)
            .map_err(|e| SimError::invalid("replay plan", e.to_string()))?;
        tokens.clear();
        tokens.resize(step.positions.len(), 0);
        sink.step_rows(&step.seqs);
        let st = engine.step(
            &StepInput {
                turn: step.turn,
                phase: step.phase,
                tokens: &tokens,
                positions: &step.positions,
            },
            &mut sink,
        )?;
        r.steps += 1;
        r.read_bytes += st.read_bytes;
        if step.phase == Phase::Decode {
            r.decode_steps += 1;
            r.decode_rows += tokens.len() as u64;
            r.decode_read_bytes += st.read_bytes;
            r.decode_routed_bytes += st.routed_bytes;
            r.decode_routings += st.experts_routed;
        }
        if let Some(f) = on_step.as_deref_mut() {
            f(&st, engine.cache()).map_err(|e| SimError::invalid("invariant", e))?;
        }
    }
    sink.flush().map_err(|e| SimError::io("trace", e))?;
    r.cache = engine.cache().counters();
    r.end = clock.now();
    r.read_retries = engine.flash().retried();
    r.faults = engine.flash().inner().fault_counts();
    Ok(r)
}
