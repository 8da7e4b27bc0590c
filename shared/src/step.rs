//! The decode step: the only caller of `Clock`, `Flash` and `Backend`, in a fixed order,
//! single-threaded and deterministic.
//!
//! One `Engine::step` runs one batch through the model — the whole prompt for prefill, one
//! token for decode — layer by layer: `dense` → `route` → router hooks → streamer (cache,
//! reads, expert compute) → `finish_layer`, then `head`. It returns the step's `StepStats`
//! and feeds route and io records to a `RecordSink`. The engine and the simulator both run
//! this code; they differ only in the three leaves.

use crate::backend::{Backend, BackendStage, LayerId, Routing, RoutingError, SlotId};
use crate::cache::{CacheError, ExpertCache};
use crate::clock::{Clock, Nanos};
use crate::flash::{Flash, FlashError, ReadId, ReadTag};
use crate::gating::Gating;
use crate::layout::{ExpertKey, ExpertLayout};
use crate::predict::{PredictConfig, Predictors};
use crate::records::{Phase, RecordSink};
use crate::streamer::{LayerIo, Streamer};
use crate::telemetry::summary::PredictReport;
use thiserror::Error;

/// How the streamer reads and computes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamConfig {
    /// `--overlap`: compute each expert as soon as its own reads are in, instead of after all
    /// of the layer's reads.
    pub overlap: bool,
    /// `--load-all`: read every expert of every MoE layer every step (a check: its output
    /// must equal the selective run's). Unrouted experts are read but not computed. With the
    /// cache on they are looked up like routed ones, so only non-resident ones are read.
    /// Under `--overlap`, waiting for those unneeded reads at the end of a layer counts as
    /// stall (the layer cannot finish before they land).
    pub load_all: bool,
    /// How a projection extent is cut into reads (`--read-split`).
    pub read_split: ReadSplit,
    /// `--prefetch K`: during each decode layer, read ahead the experts the previous token
    /// routed at the next `K` MoE layers (0 = off; needs the cache). See `prefetch`.
    pub prefetch: u32,
}

/// How the streamer cuts an expert's projection extents into reads (`--read-split`). Demand
/// and speculative reads of an expert are always cut the same way.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum ReadSplit {
    /// One read per projection extent. With three projections a single missed expert keeps at
    /// most three lanes busy, and the lanes finish at different times (the projections differ
    /// in size).
    #[default]
    Whole,
    /// Pieces of at most this many bytes (> 0).
    MaxBytes(u64),
    /// Each extent in as many equal pieces as there are lanes (4 KiB multiples, none smaller
    /// than `SPLIT_MIN_BYTES`): with lanes round-robin every lane reads one piece of every
    /// projection, so one missed expert keeps every lane busy and the lanes finish together.
    Lanes,
    /// `Lanes` where a layer reads a few missed experts (decode with the cache on), whole
    /// extents where a wave already has an extent for every lane (cache off, prefill): there
    /// splitting only makes the requests smaller, and this disk reads large ones faster
    /// (cache off, 4 lanes: 1640–1717 MiB/s whole against 1448–1463 in lane pieces).
    Auto,
}

/// Smallest piece `ReadSplit::Lanes` cuts: below this a request's fixed cost outweighs what a
/// further lane adds.
pub const SPLIT_MIN_BYTES: u64 = 64 * 1024;

impl ReadSplit {
    /// Size of the pieces an extent of `extent_bytes` is read in with `lanes` lanes (the last
    /// piece may be shorter). Never 0 for a non-empty extent.
    /// `Auto` cuts as `Lanes` here; see `resolve`.
    pub fn piece_bytes(self, extent_bytes: u64, lanes: u32) -> u64 {
        match self {
            ReadSplit::Whole => extent_bytes,
            ReadSplit::MaxBytes(m) => m.max(1),
            ReadSplit::Lanes | ReadSplit::Auto => {
                let lanes = u64::from(lanes.max(1));
                let even = extent_bytes.div_ceil(lanes).div_ceil(4096) * 4096;
                even.max(SPLIT_MIN_BYTES)
            }
        }
        .max(1)
    }

    /// The cut for one wave of reads: `Auto` becomes `Lanes` in a decode step with the cache
    /// on — always, so that a speculative read (decode, cache on) is cut exactly like the
    /// demand read that adopts it — and otherwise `Whole` when the wave has at least
    /// `extents >= lanes` extents (`Lanes` when fewer). Other variants are returned as they are.
    pub fn resolve(self, cache_on: bool, decode: bool, extents: usize, lanes: u32) -> ReadSplit {
        match self {
            ReadSplit::Auto if cache_on && decode => ReadSplit::Lanes,
            ReadSplit::Auto if extents >= lanes.max(1) as usize => ReadSplit::Whole,
            ReadSplit::Auto => ReadSplit::Lanes,
            other => other,
        }
    }

    /// The `--read-split` / CSV preamble spelling: `off`, `lanes`, `auto` or a size in KiB.
    pub fn name(self) -> String {
        match self {
            ReadSplit::Whole => "off".to_string(),
            ReadSplit::Lanes => "lanes".to_string(),
            ReadSplit::Auto => "auto".to_string(),
            ReadSplit::MaxBytes(b) => format!("{}", b.div_ceil(1024)),
        }
    }

    /// Parse the `--read-split` spelling (`off`, `lanes`, `auto`, or a whole number of KiB
    /// ≥ 4).
    pub fn parse(s: &str) -> Result<ReadSplit, String> {
        match s {
            "off" => Ok(ReadSplit::Whole),
            "lanes" => Ok(ReadSplit::Lanes),
            "auto" => Ok(ReadSplit::Auto),
            n => match n.parse::<u64>() {
                Ok(k) if (4..=1 << 30).contains(&k) && n.bytes().all(|b| b.is_ascii_digit()) => {
                    Ok(ReadSplit::MaxBytes(k * 1024))
                }
                _ => Err(format!(
                    "'{s}' is not off, lanes, auto, or a whole number of KiB in [4, 2^30]"
                )),
            },
        }
    }
}

/// One step's batch.
#[derive(Copy, Clone, Debug)]
pub struct StepInput<'a> {
    /// Session turn (0 for a one-shot run).
    pub turn: u32,
    pub phase: Phase,
    /// Token ids, one per batch row.
    pub tokens: &'a [u32],
    /// Absolute context position of each token.
    pub positions: &'a [u32],
}

/// What one step cost and did. Times come from the engine's `Clock`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Tokens in the batch.
    pub tokens: u32,
    /// The whole step, `begin` to `head`.
    pub wall: Nanos,
    /// Serial: wall time from submitting a layer's reads to the last one landing, summed over
    /// layers (a subset of `wall`). Overlap: summed per-read lane busy time (`lane_busy`),
    /// which can exceed `wall`.
    pub io: Nanos,
    /// Σ (end − start) over every read, in both modes.
    pub lane_busy: Nanos,
    /// Overlap only (0 in serial): wall time the step waited for a read with nothing else to
    /// compute — the union of stalled intervals.
    pub stall: Nanos,
    /// Cache management: lookups, admissions and evictions, `Backend::release`, unpinning.
    pub mgmt: Nanos,
    /// Reads completed.
    pub reads: u64,
    /// Bytes pulled from flash (aligned windows, from `ReadDone::read_bytes`).
    pub read_bytes: u64,
    /// Bytes the reads asked for.
    pub req_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub rereads: u64,
    pub inserts: u64,
    /// Routings (row × rank) over all MoE layers, dropped ones included.
    pub experts_routed: u64,
    /// Routings discarded by a dropping hook.
    pub experts_dropped: u64,
    /// Routing slots a re-ranking hook examined (`--expert-substitute`).
    pub experts_reranked: u64,
    /// Slots a re-ranking hook moved to a different (resident) expert.
    pub experts_substituted: u64,
    /// Σ over MoE layers of (distinct non-dropped routed experts × expert bytes): the
    /// measured `token_demand` of a decode step.
    pub routed_bytes: u64,
    /// The same per MoE layer (`layer_demand` is the widest).
    pub layer_routed_bytes: Vec<u64>,
    /// Layers that needed more than one admission wave (their union exceeded the budget).
    pub extra_waves: u32,
    /// `--prefetch`: speculative reads completed (included in `reads`).
    pub spec_reads: u64,
    /// Bytes those pulled from flash (included in `read_bytes`).
    pub spec_read_bytes: u64,
    /// Experts admitted speculatively (their reads submitted).
    pub spec_issued: u64,
    /// Speculative experts whose every read landed (fully read ahead).
    pub spec_experts: u64,
    /// Routings whose lookup hit a speculatively admitted expert on its first touch.
    pub spec_useful: u64,
    /// Speculative reads cancelled before they started (including ones pulled back so
    /// demand could pass, which are resubmitted).
    pub spec_cancelled: u64,
    /// Speculative experts given up (not needed and incomplete, failed, or displaced by demand).
    pub spec_dropped: u64,
    /// Speculative reads that failed where no layer needed them (dropped, not fatal).
    pub spec_failed: u64,
    /// `--predict-log`: this step's probe results (`None` when the probe is off or the step
    /// was not a single-row decode step).
    pub predict: Option<PredictReport>,
    /// `--route-ahead`: decode routings whose selection was replaced by the prediction.
    pub ra_committed: u64,
    /// Decode routings that kept the router's choice (layers < N, the first decode token, no
    /// prediction or no router probabilities to weight it).
    pub ra_passthrough: u64,
    /// Committed slots, and how many of them the router also chose.
    pub ra_slots: u64,
    pub ra_agreed_slots: u64,
    /// Time in the route-ahead predictions (`Backend::predict` at horizon N), by the `Clock`,
    /// and how many there were.
    pub ra_gemv_ns: u64,
    pub ra_gemv_jobs: u64,
}

/// A router hook failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{message}")]
pub struct HookError {
    pub message: String,
}

/// Why a step failed. Every variant except `BadInput` poisons the engine: the failed step may
/// have left the backend and cache half-way, so later steps return `Poisoned` (STYLE 12).
#[derive(Debug, Error)]
pub enum StepError {
    #[error(
        "step input has {tokens} tokens and {positions} positions; need the same number, 1..2^32"
    )]
    BadInput { tokens: usize, positions: usize },
    #[error("flash read for MoE layer {} expert {} projection {} failed: {source}", .tag.layer, .tag.expert, .tag.proj)]
    Flash {
        tag: ReadTag,
        #[source]
        source: FlashError,
    },
    #[error("flash delivered a completion for read {id}, which this step did not submit or already received")]
    UnexpectedCompletion { id: ReadId },
    #[error("backend {stage} failed at model layer {layer}: {source}")]
    Backend {
        stage: BackendStage,
        layer: u32,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("routing of MoE layer {layer}: {source}")]
    Routing {
        layer: u16,
        #[source]
        source: RoutingError,
    },
    #[error("router hook {hook} failed at MoE layer {layer}: {source}")]
    Hook {
        hook: &'static str,
        layer: u16,
        #[source]
        source: HookError,
    },
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("flash device has no lanes")]
    NoLanes,
    #[error("the cache was built for {cache_keys} experts but the layout has {layout_keys}")]
    CacheLayoutMismatch { cache_keys: u32, layout_keys: u32 },
    #[error("a resident device reads nothing, so an expert cache over it (budget {budget_bytes} bytes) would hold nothing: build it with budget 0")]
    ResidentWithCache { budget_bytes: u64 },
    #[error("an earlier step failed ({first}); its output is untrustworthy and this engine refuses further steps")]
    Poisoned { first: String },
}

/// What a router hook may look at.
pub struct HookContext<'a> {
    pub layer: LayerId,
    pub phase: Phase,
    /// The batch's positions (`Routing::batch_row` indexes them).
    pub positions: &'a [u32],
    /// Residency, for cache-aware hooks (dropping, substitution). Read-only.
    pub cache: &'a ExpertCache,
    pub layout: &'a ExpertLayout,
}

/// Edits a layer's routing after the router and before anything reads it: the seam for
/// `--n-expert-used`, `--expert-substitute`, `--drop-cold-experts` and `--route-ahead`.
/// Hooks run in the order they were added; the step re-validates the routing after them.
pub trait RouterHook: Send {
    /// Name for errors and reports.
    fn name(&self) -> &'static str;
    /// Edit `routing` in place (ids, weights, `drop_entry`, `truncate_k`).
    fn apply(&mut self, cx: &HookContext<'_>, routing: &mut Routing) -> Result<(), HookError>;
    /// What the hook did since the last call, for the step's counters; resets them. Hooks
    /// that count nothing keep the default. (Drops are counted from `Routing::dropped` by the
    /// streamer, so a dropping hook need not report them.)
    fn take_counts(&mut self) -> HookCounts {
        HookCounts::default()
    }
}

/// Per-hook counts a step adds to its `StepStats`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct HookCounts {
    /// Routing slots examined by a re-ranking hook.
    pub reranked: u64,
    /// Slots moved to a different expert.
    pub substituted: u64,
}

/// `--n-expert-used k`: keep the first `k` ranks of every routing, weighted as the router
/// itself would weigh them at top-k `k` under the model's gating: from the row's full scores
/// when the backend supplied them (`Gating::weights_for`, the router's own arithmetic — for
/// qwen3moe `p_j / max(Σ kept p, 6.1035e-5)`), else from the weights alone (`Gating::narrow`:
/// a normalising gating divides the kept weights by their sum, the others keep them).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct TopKOverride {
    pub k: u16,
    pub gating: Gating,
}

impl RouterHook for TopKOverride {
    fn name(&self) -> &'static str {
        "n-expert-used"
    }

    fn apply(&mut self, _cx: &HookContext<'_>, routing: &mut Routing) -> Result<(), HookError> {
        let k = self.k as usize;
        if k == 0 || k >= routing.k() {
            return Ok(());
        }
        let mut w = [0f32; 64];
        for r in 0..routing.n_rows() {
            match routing.probs(r) {
                Some(p) if k <= w.len() => {
                    self.gating
                        .weights_for(p, &routing.ids(r)[..k], &mut w[..k]);
                    routing.weights_mut(r)[..k].copy_from_slice(&w[..k]);
                }
                Some(p) => {
                    let mut wide = vec![0f32; k];
                    self.gating.weights_for(p, &routing.ids(r)[..k], &mut wide);
                    routing.weights_mut(r)[..k].copy_from_slice(&wide);
                }
                None => self.gating.narrow(routing.weights_mut(r), k),
            }
        }
        routing.truncate_k(k);
        Ok(())
    }
}

/// The decode step over a clock, a flash device and a backend.
pub struct Engine<C: Clock, F: Flash, B: Backend> {
    clock: C,
    flash: F,
    backend: B,
    layout: ExpertLayout,
    cache: ExpertCache,
    config: StreamConfig,
    hooks: Vec<Box<dyn RouterHook>>,
    routing: Routing,
    streamer: Streamer,
    predictors: Predictors,
    failed: Option<String>,
}

impl<C: Clock, F: Flash, B: Backend> Engine<C, F, B> {
    /// Assemble a step engine. `cache` must have been built over `layout` (budget 0 = off).
    pub fn new(
        clock: C,
        flash: F,
        backend: B,
        layout: ExpertLayout,
        cache: ExpertCache,
        config: StreamConfig,
    ) -> Result<Self, StepError> {
        if flash.lanes() == 0 {
            return Err(StepError::NoLanes);
        }
        if flash.resident() && !cache.is_off() {
            return Err(StepError::ResidentWithCache {
                budget_bytes: cache.budget_bytes(),
            });
        }
        if cache.n_keys() != layout.n_keys() {
            return Err(StepError::CacheLayoutMismatch {
                cache_keys: cache.n_keys(),
                layout_keys: layout.n_keys(),
            });
        }
        let streamer = Streamer::new(&layout);
        let predictors = Predictors::new(PredictConfig::default(), layout.n_moe_layers());
        Ok(Engine {
            clock,
            flash,
            backend,
            layout,
            cache,
            config,
            hooks: Vec::new(),
            routing: Routing::new(),
            streamer,
            predictors,
            failed: None,
        })
    }

    /// Arm the expert predictors (`--predict-log`, `--predict-prefetch`, `--route-ahead`,
    /// `--prefetch-sync`; see `predict.rs`). Call before the first step; the engine and the
    /// simulator both call it with `PredictConfig::from_run_config`.
    pub fn set_predictors(&mut self, cfg: PredictConfig) {
        self.predictors = Predictors::new(cfg, self.layout.n_moe_layers());
    }

    /// The armed predictors.
    pub fn predict_config(&self) -> &PredictConfig {
        &self.predictors.cfg
    }

    /// Append a router hook (hooks run in the order added).
    pub fn add_hook(&mut self, hook: Box<dyn RouterHook>) {
        self.hooks.push(hook);
    }

    /// Run one batch through the model. See the module documentation for the order of calls.
    /// On any error the engine is poisoned: this and every later call return an error.
    pub fn step(
        &mut self,
        input: &StepInput<'_>,
        sink: &mut dyn RecordSink,
    ) -> Result<StepStats, StepError> {
        if let Some(first) = &self.failed {
            return Err(StepError::Poisoned {
                first: first.clone(),
            });
        }
        if input.tokens.is_empty()
            || input.tokens.len() != input.positions.len()
            || input.tokens.len() > u32::MAX as usize
        {
            return Err(StepError::BadInput {
                tokens: input.tokens.len(),
                positions: input.positions.len(),
            });
        }
        let mut stats = StepStats {
            tokens: input.tokens.len() as u32,
            layer_routed_bytes: vec![0; self.layout.n_moe_layers() as usize],
            ..Default::default()
        };
        let before = self.cache.counters();
        let start = self.clock.now();
        if let Err(e) = self.run(input, sink, &mut stats) {
            self.failed = Some(e.to_string());
            return Err(e);
        }
        stats.wall = self.clock.now() - start;
        if self.config.overlap {
            stats.io = stats.lane_busy;
        }
        let delta = self.cache.counters().since(before);
        stats.hits = delta.hits;
        stats.misses = delta.misses;
        stats.evictions = delta.evictions;
        stats.rereads = delta.rereads;
        stats.inserts = delta.inserts;
        Ok(stats)
    }

    fn run(
        &mut self,
        input: &StepInput<'_>,
        sink: &mut dyn RecordSink,
        stats: &mut StepStats,
    ) -> Result<(), StepError> {
        let Engine {
            clock,
            flash,
            backend,
            layout,
            cache,
            config,
            hooks,
            routing,
            streamer,
            predictors,
            ..
        } = self;
        let n_tokens = input.tokens.len() as u32;
        predictors.begin_step(input.phase, input.tokens.len());
        let wants_routes = sink.wants_routes();
        backend
            .begin_step(input)
            .map_err(be(BackendStage::Begin, 0))?;
        for model_layer in 0..layout.n_model_layers() {
            backend
                .dense(model_layer)
                .map_err(be(BackendStage::Dense, model_layer))?;
            let Some(moe) = layout.moe_index(model_layer) else {
                continue;
            };
            let layer = LayerId {
                model: model_layer,
                moe,
            };
            let n_expert = layout.layer(moe).map_or(0, |l| l.n_expert);
            routing.reset(n_expert, n_tokens);
            backend
                .route(layer, routing)
                .map_err(be(BackendStage::Route, model_layer))?;
            if predictors.cfg.predicts() {
                predictors.after_route(&*clock, &mut *backend, layout, layer, routing, stats)?;
                // Route-ahead first: every other hook, the trace and the loader see the
                // committed routing (see hooks/route_ahead.rs).
                predictors.commit(layer, routing, stats);
            }
            if !hooks.is_empty() {
                let cx = HookContext {
                    layer,
                    phase: input.phase,
                    positions: input.positions,
                    cache,
                    layout,
                };
                for hook in hooks.iter_mut() {
                    hook.apply(&cx, routing).map_err(|source| StepError::Hook {
                        hook: hook.name(),
                        layer: moe,
                        source,
                    })?;
                    let counts = hook.take_counts();
                    stats.experts_reranked += counts.reranked;
                    stats.experts_substituted += counts.substituted;
                }
            }
            routing
                .validate(moe)
                .map_err(|source| StepError::Routing { layer: moe, source })?;
            if predictors.cfg.predicts() {
                predictors.score(layer, routing);
                predictors.plan(layer, routing.k(), wants_routes);
            }
            let mut io = LayerIo {
                clock: &*clock,
                flash: &mut *flash,
                backend: &mut *backend,
                cache: &mut *cache,
                layout: &*layout,
                config: &*config,
                sink: &mut *sink,
                stats: &mut *stats,
                turn: input.turn,
                phase: input.phase,
                positions: input.positions,
                layer_moe: moe,
                predict: &predictors.cfg,
                spec: &predictors.spec,
                trace_preds: &predictors.trace,
                router_ids: if predictors.committed {
                    &predictors.router_ids
                } else {
                    &[]
                },
            };
            streamer.run_layer(&mut io, layer, routing)?;
        }
        predictors.end_step(stats);
        backend
            .head()
            .map_err(be(BackendStage::Head, layout.n_model_layers()))?;
        Ok(())
    }

    /// Change the cache budget between steps, releasing what it evicts. Same floor as at
    /// construction; a cache cannot be turned on or off this way.
    pub fn set_cache_budget(&mut self, budget_bytes: u64) -> Result<(), StepError> {
        if let Some(first) = &self.failed {
            return Err(StepError::Poisoned {
                first: first.clone(),
            });
        }
        let mut evicted: Vec<ExpertKey> = Vec::new();
        let result = self.cache.set_budget(budget_bytes, &mut evicted);
        for key in evicted {
            let model = self.layout.layer(key.layer).map_or(0, |l| l.model_layer);
            if let Err(e) = self
                .backend
                .release(SlotId::Canonical(key))
                .map_err(be(BackendStage::Release, model))
            {
                self.failed = Some(e.to_string());
                return Err(e);
            }
        }
        result.map_err(StepError::from)
    }

    /// The clock.
    pub fn clock(&self) -> &C {
        &self.clock
    }
    /// The flash device.
    pub fn flash(&self) -> &F {
        &self.flash
    }
    /// The flash device, mutably (between steps).
    pub fn flash_mut(&mut self) -> &mut F {
        &mut self.flash
    }
    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }
    /// The backend, mutably (between steps: logits, KV management).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }
    /// The expert cache.
    pub fn cache(&self) -> &ExpertCache {
        &self.cache
    }
    /// The expert layout.
    pub fn layout(&self) -> &ExpertLayout {
        &self.layout
    }
    /// The stream configuration.
    pub fn config(&self) -> &StreamConfig {
        &self.config
    }
    /// The first failure, once the engine is poisoned.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }
    /// Take the engine apart.
    pub fn into_parts(self) -> (C, F, B, ExpertCache) {
        (self.clock, self.flash, self.backend, self.cache)
    }
}

/// Map a backend error into `StepError::Backend` for `stage` at model layer `layer`.
pub(crate) fn be<E: std::error::Error + Send + Sync + 'static>(
    stage: BackendStage,
    layer: u32,
) -> impl FnOnce(E) -> StepError {
    move |e| StepError::Backend {
        stage,
        layer,
        source: Box::new(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{MoeLayerLayout, ProjExtent};
    use crate::policy::Lru;

    fn cx_parts() -> (ExpertLayout, ExpertCache) {
        let layout = ExpertLayout::new(
            1,
            vec![MoeLayerLayout {
                model_layer: 0,
                n_expert: 4,
                projections: vec![ProjExtent {
                    shard: 0,
                    base_offset: 0,
                    stride_bytes: 1,
                }],
                dense_bytes: 0,
            }],
            3,
        )
        .unwrap();
        let cache = ExpertCache::new(&layout, 0, 3, Box::new(Lru::new())).unwrap();
        (layout, cache)
    }

    #[test]
    fn read_split_pieces() {
        // A Q4_K_M 30B-shape gate extent (884,736 B) over 4 lanes: 4 pieces of 221,184 B.
        assert_eq!(ReadSplit::Lanes.piece_bytes(884_736, 4), 221_184);
        assert_eq!(884_736u64.div_ceil(221_184), 4);
        // Down (1,290,240 B) over 4 lanes: 322,560 rounded up to a 4 KiB multiple.
        assert_eq!(ReadSplit::Lanes.piece_bytes(1_290_240, 4), 323_584);
        assert_eq!(1_290_240u64.div_ceil(323_584), 4);
        // Small extents are not cut below 64 KiB; one lane reads whole extents.
        assert_eq!(ReadSplit::Lanes.piece_bytes(100_000, 8), SPLIT_MIN_BYTES);
        assert_eq!(ReadSplit::Lanes.piece_bytes(884_736, 1), 884_736);
        assert_eq!(ReadSplit::Whole.piece_bytes(884_736, 4), 884_736);
        assert_eq!(ReadSplit::MaxBytes(4096).piece_bytes(884_736, 4), 4096);
        for s in ["off", "lanes", "auto", "256"] {
            assert_eq!(ReadSplit::parse(s).unwrap().name(), s);
        }
        // Auto: a cached decode step always splits (speculation is cut like the demand read
        // that adopts it), whatever the wave; elsewhere whole once every lane has an extent.
        let a = ReadSplit::Auto;
        assert_eq!(a.resolve(true, true, 24, 4), ReadSplit::Lanes);
        assert_eq!(a.resolve(true, true, 0, 4), ReadSplit::Lanes);
        assert_eq!(a.resolve(false, true, 24, 4), ReadSplit::Whole);
        assert_eq!(a.resolve(false, true, 4, 4), ReadSplit::Whole);
        assert_eq!(a.resolve(false, true, 3, 4), ReadSplit::Lanes);
        assert_eq!(a.resolve(true, false, 6, 4), ReadSplit::Whole);
        assert_eq!(a.resolve(true, false, 3, 8), ReadSplit::Lanes);
        for other in [
            ReadSplit::Whole,
            ReadSplit::Lanes,
            ReadSplit::MaxBytes(8192),
        ] {
            assert_eq!(other.resolve(false, false, 100, 4), other);
        }
        for bad in ["", "0", "3", "4x", "-8", "lane", "1.5"] {
            assert!(ReadSplit::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn top_k_override_renormalises_from_probs_like_qwen3moe() {
        let (layout, cache) = cx_parts();
        let cx = HookContext {
            layer: LayerId { model: 0, moe: 0 },
            phase: Phase::Decode,
            positions: &[0],
            cache: &cache,
            layout: &layout,
        };
        let probs = [0.1f32, 0.4, 0.3, 0.2];
        let mut r = Routing::new();
        r.reset(4, 1);
        // Top-3 of probs, renormalised over the three.
        r.push_row_with_probs(0, &[1, 2, 3], &[0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9], &probs)
            .unwrap();
        let mut hook = TopKOverride {
            k: 2,
            gating: Gating::SOFTMAX_RENORM,
        };
        hook.apply(&cx, &mut r).unwrap();
        assert_eq!(r.k(), 2);
        assert_eq!(r.ids(0), &[1, 2]);
        let denom = 0.4f32 + 0.3f32;
        assert_eq!(r.weights(0), &[0.4 / denom, 0.3 / denom]);

        // Without probabilities: the kept weights are divided by their sum.
        let mut r = Routing::new();
        r.reset(4, 1);
        r.push_row(0, &[1, 2, 3], &[0.5, 0.3, 0.2]).unwrap();
        hook.apply(&cx, &mut r).unwrap();
        assert_eq!(r.weights(0), &[0.5 / 0.8, 0.3 / 0.8]);

        // Without renormalisation the weights stay as the router gave them.
        let mut r = Routing::new();
        r.reset(4, 1);
        r.push_row(0, &[1, 2, 3], &[0.5, 0.3, 0.2]).unwrap();
        TopKOverride {
            k: 1,
            gating: Gating::SOFTMAX,
        }
        .apply(&cx, &mut r)
        .unwrap();
        assert_eq!((r.ids(0), r.weights(0)), (&[1u16][..], &[0.5f32][..]));

        // A k at or above the routing's width changes nothing.
        let mut r = Routing::new();
        r.reset(4, 1);
        r.push_row(0, &[1, 2], &[0.6, 0.4]).unwrap();
        hook.k = 8;
        hook.apply(&cx, &mut r).unwrap();
        assert_eq!(r.weights(0), &[0.6, 0.4]);
    }
}
