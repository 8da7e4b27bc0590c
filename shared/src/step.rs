//! The decode step: the only caller of `Clock`, `Flash` and `Backend`, in a fixed order,
//! single-threaded and deterministic.
//!
//! One `Engine::step` runs one batch through the model — the whole prompt for prefill, one
//! token for decode — layer by layer: `dense` → `route` → router hooks → streamer (cache,
//! reads, expert compute) → `finish_layer`, then `head`. It returns the step's `StepStats`
//! and feeds route and io records to a `RecordSink`. The engine and the simulator both run
//! this code; they differ only in the three leaves.

use crate::backend::{Backend, Routing};
use crate::cache::ExpertCache;
use crate::clock::Clock;
use crate::flash::Flash;
pub use crate::hooks::{HookContext, HookCounts, RouterHook, TopKOverride};
use crate::layout::{ExpertKey, ExpertLayout};
use crate::policy::StepContext;
use crate::predict::{PredictConfig, Predictors};
use crate::prefetch::LayerIo;
use crate::records::RecordSink;
use crate::streamer::Streamer;
use crate::vocab::be;
use crate::vocab::{BackendStage, LayerId, SlotId};
pub use crate::vocab::{
    HookError, ReadSplit, StepError, StepInput, StepStats, StreamConfig, SPLIT_MIN_BYTES,
};

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
        sink.begin_step(input.turn, input.phase);
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
        stats.bypasses = delta.bypasses;
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
        cache.begin_step(&StepContext {
            turn: input.turn,
            phase: input.phase,
            n_rows: n_tokens,
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gating::Gating;
    use crate::layout::{MoeLayerLayout, ProjExtent};
    use crate::policy::Lru;
    use crate::records::Phase;

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
