//! Expert prediction (features.md §5, §6): the stale-gate predictor and the three consumers of
//! it — the `--predict-log` probe, `--predict-prefetch` speculation and `--route-ahead`.
//!
//! Right after `Backend::route(l)` of a decode step (single-row batches only) the step asks the
//! backend, through `Backend::predict`, for what later layers' routers would choose on layer
//! `l`'s router input: target `l+h` is the *stale gate* of horizon `h` (`h = 0` is the control,
//! the router itself). Each prediction is kept for the rest of the step, per (target, horizon),
//! so that layer `l+h` can grade it (`--predict-log`), commit it (`--route-ahead h`) or — at
//! layer `l`, right away — read its misses ahead (`--predict-prefetch`, route-ahead's early
//! reads). The predictions are also written into the route trace (`RouteRecord::preds`) so the
//! simulator can replay these predictors without hidden states.
//!
//! Which horizons a step computes:
//! - `--predict-log`: 0 (ctrl), 1 (stale), 2 (stale-2);
//! - `--predict-prefetch`: 1 and 2;
//! - `--route-ahead N`: N.
//!
//! The first decode token after a prefill and prefill itself are not predicted: the contract
//! counts them as unscored (probe) and passed through (route-ahead).
//!
//! Everything here is a function of the routing and the backend's predictions, both of which
//! the simulator reproduces, so the engine and a replay make the same decisions.

use crate::backend::{Backend, BackendStage, LayerId, Prediction, Routing};
use crate::clock::Clock;
use crate::config::RunConfig;
use crate::gating::Gating;
use crate::hooks::route_ahead;
use crate::layout::ExpertLayout;
use crate::records::{Phase, PRED_HORIZON_MAX};
use crate::vocab::{be, PredictReport, PredictorStats, StepError, StepStats};

/// Routings wider than this are declined by the probe (features.md §5).
pub const PREDICT_SCORE_MAX_K: usize = 32;

/// Which predictors a run arms (from `RunConfig`, already validated).
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct PredictConfig {
    /// `--predict-log`: score stale-gate, stale-2, prev-token and the control.
    pub log: bool,
    /// `--predict-prefetch`: read the predicted misses of the next two layers.
    pub prefetch: bool,
    /// `--predict-spec-max N`: at most N predicted misses read per target layer (0 = retention
    /// only: predicted residents are touched in the eviction policy, nothing is read).
    pub spec_max: u32,
    /// `--route-ahead N`: commit layer L's routing from the prediction made at L−N (0 = off).
    pub route_ahead: u32,
    /// `--drop-cold-experts F`: the drop-aware filter skips predicted experts whose predicted
    /// weight is below `F / k` (the top one always kept). 0 = no filter.
    pub drop_frac: f32,
    /// `--prefetch-sync`: speculative reads are waited for inline on the eval thread, right
    /// after they are issued (tests only).
    pub sync: bool,
    /// The model's gating: how route-ahead weighs a committed routing and how the drop-aware
    /// filter narrows a prediction's weights.
    pub gating: Gating,
}

impl PredictConfig {
    /// The predictors `cfg` arms. Horizons are clamped to `PRED_HORIZON_MAX`.
    pub fn from_run_config(cfg: &RunConfig) -> PredictConfig {
        PredictConfig {
            log: cfg.predict_log,
            prefetch: cfg.predict_prefetch,
            spec_max: cfg.predict_spec_max,
            route_ahead: cfg.route_ahead.min(PRED_HORIZON_MAX as u32),
            drop_frac: if cfg.drop_cold_frac > 0.0 {
                cfg.drop_cold_frac
            } else {
                0.0
            },
            sync: cfg.prefetch_sync,
            gating: cfg.gating,
        }
    }

    /// Whether the step must ask the backend for predictions at all.
    pub fn predicts(&self) -> bool {
        self.log || self.prefetch || self.route_ahead > 0
    }

    /// Whether a speculative source other than `--prefetch` needs the prefetcher.
    pub(crate) fn speculates(&self) -> bool {
        self.prefetch || self.route_ahead > 0
    }

    /// Whether horizon `h` (0 = control) is computed.
    fn wants(&self, h: usize) -> bool {
        (self.log && h <= 2)
            || (self.prefetch && (h == 1 || h == 2))
            || (h > 0 && self.route_ahead as usize == h)
    }
}

/// One later layer's predicted experts to read ahead (or retain), built per layer by
/// `Predictors::plan` for the prefetcher.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct SpecTarget {
    pub target: u16,
    /// Candidates in predicted rank order (already filtered drop-aware).
    pub experts: Vec<u16>,
    /// Most misses read for this target layer this step (`u32::MAX` = no cap).
    pub cap: u32,
    /// Route-ahead's committed routing: never cancelled, no cap.
    pub committed: bool,
}

/// Route-ahead's counters for one step.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RouteAheadCounts {
    pub committed: u64,
    pub passthrough: u64,
    pub slots: u64,
    pub agreed_slots: u64,
}

/// Per-step prediction state, owned by the decode step.
#[derive(Debug)]
pub(crate) struct Predictors {
    pub cfg: PredictConfig,
    n_moe: usize,
    /// `(target, horizon)` → prediction, valid when `stamp` equals the current step.
    table: Vec<Prediction>,
    stamp: Vec<u64>,
    step_id: u64,
    /// This step is a single-row decode step.
    eligible: bool,
    /// …and the first one after a prefill (or the first ever): nothing is predicted.
    first: bool,
    decoded_since_prefill: bool,
    /// The router's own ids (last row, before any hook) at the layer being routed.
    pub router_ids: Vec<u16>,
    /// Route-ahead committed the current layer's routing.
    pub committed: bool,
    /// Per MoE layer: the router's ids (before hooks) for the previous decode token.
    prev: Vec<Vec<u16>>,
    prev_ok: Vec<bool>,
    report: PredictReport,
    scratch: Prediction,
    /// The current layer's speculation plan (read by the prefetcher).
    pub spec: Vec<SpecTarget>,
    /// The current layer's per-slot predictions for the route trace (last row, decode).
    pub trace: Vec<[Option<(u16, f32)>; PRED_HORIZON_MAX]>,
}

const STRIDE: usize = PRED_HORIZON_MAX + 1;

impl Predictors {
    pub(crate) fn new(cfg: PredictConfig, n_moe: u16) -> Predictors {
        let n = n_moe as usize * STRIDE;
        Predictors {
            cfg,
            n_moe: n_moe as usize,
            table: vec![Prediction::default(); if cfg.predicts() { n } else { 0 }],
            stamp: vec![0; if cfg.predicts() { n } else { 0 }],
            step_id: 0,
            eligible: false,
            first: false,
            decoded_since_prefill: false,
            router_ids: Vec::new(),
            committed: false,
            prev: vec![Vec::new(); n_moe as usize],
            prev_ok: vec![false; n_moe as usize],
            report: PredictReport::default(),
            scratch: Prediction::default(),
            spec: Vec::new(),
            trace: Vec::new(),
        }
    }

    /// Start a step of `n_tokens` rows in `phase`.
    pub(crate) fn begin_step(&mut self, phase: Phase, n_tokens: usize) {
        self.step_id += 1;
        self.eligible = self.cfg.predicts() && phase == Phase::Decode && n_tokens == 1;
        self.first = self.eligible && !self.decoded_since_prefill;
        match phase {
            Phase::Prefill => self.decoded_since_prefill = false,
            Phase::Decode if self.eligible => self.decoded_since_prefill = true,
            Phase::Decode => {}
        }
        if self.cfg.log {
            self.report = PredictReport {
                by_layer: vec![[PredictorStats::default(); 3]; self.n_moe],
                ..PredictReport::default()
            };
        }
    }

    fn get(&self, target: u16, h: usize) -> Option<&Prediction> {
        self.slot(target, h).map(|i| &self.table[i])
    }

    /// Index of the (target, horizon) prediction when this step made one.
    fn slot(&self, target: u16, h: usize) -> Option<usize> {
        let i = target as usize * STRIDE + h;
        (self.stamp.get(i) == Some(&self.step_id)).then_some(i)
    }

    /// Right after `route(layer)`: snapshot the router's choice and compute the predictions
    /// this step needs from this layer's router input. Route-ahead's GEMV time is charged to
    /// `stats.ra_gemv_ns`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn after_route<C: Clock, B: Backend>(
        &mut self,
        clock: &C,
        backend: &mut B,
        layout: &ExpertLayout,
        layer: LayerId,
        routing: &Routing,
        stats: &mut StepStats,
    ) -> Result<(), StepError> {
        self.router_ids.clear();
        self.committed = false;
        self.spec.clear();
        self.trace.clear();
        if !self.eligible || routing.n_rows() == 0 {
            return Ok(());
        }
        let last = (0..routing.n_rows())
            .max_by_key(|&r| routing.batch_row(r))
            .unwrap_or(0);
        self.router_ids.extend_from_slice(routing.ids(last));
        if self.first {
            return Ok(());
        }
        let k = routing.k();
        for h in 0..=PRED_HORIZON_MAX {
            let t = layer.moe as usize + h;
            if !self.cfg.wants(h) || t >= self.n_moe {
                continue;
            }
            let Some(tl) = layout.layer(t as u16) else {
                continue;
            };
            let target = LayerId {
                model: tl.model_layer,
                moe: t as u16,
            };
            let t0 = clock.now();
            let ok = backend
                .predict(layer, target, k, &mut self.scratch)
                .map_err(be(BackendStage::Route, layer.model))?;
            if h > 0 && h == self.cfg.route_ahead as usize {
                stats.ra_gemv_ns += (clock.now() - t0).0;
                stats.ra_gemv_jobs += 1;
            }
            let valid = ok
                && !self.scratch.ids.is_empty()
                && self.scratch.ids.len() == self.scratch.weights.len()
                && self.scratch.ids.len() <= k;
            if valid {
                let i = t * STRIDE + h;
                std::mem::swap(&mut self.table[i], &mut self.scratch);
                self.stamp[i] = self.step_id;
            }
        }
        Ok(())
    }

    /// `--route-ahead N`, before every other router hook: replace the routing of this layer
    /// with the prediction made N layers earlier (weights = the router's true probabilities of
    /// the committed ids, renormalised), or count it passed through. Decode only.
    pub(crate) fn commit(&mut self, layer: LayerId, routing: &mut Routing, stats: &mut StepStats) {
        let n = self.cfg.route_ahead as usize;
        if n == 0 || !self.eligible || routing.n_rows() == 0 {
            return;
        }
        let last = (0..routing.n_rows())
            .max_by_key(|&r| routing.batch_row(r))
            .unwrap_or(0);
        let counts = if self.first || (layer.moe as usize) < n {
            None
        } else {
            self.get(layer.moe, n)
                .and_then(|p| route_ahead::commit(routing, last, &p.ids, self.cfg.gating))
        };
        match counts {
            Some(c) => {
                self.committed = true;
                stats.ra_committed += 1;
                stats.ra_slots += c.slots;
                stats.ra_agreed_slots += c.agreed;
            }
            None => stats.ra_passthrough += 1,
        }
    }

    /// `--predict-log`, after the router hooks (so `routing.k()` is the applied width): grade
    /// the predictions of this layer against the router's own choice, then remember that
    /// choice as the next token's prev-token prediction.
    pub(crate) fn score(&mut self, layer: LayerId, routing: &Routing) {
        if !self.cfg.log || !self.eligible || self.router_ids.is_empty() {
            return;
        }
        let l = layer.moe as usize;
        let k = routing.k().min(self.router_ids.len());
        if k == 0 || k > PREDICT_SCORE_MAX_K {
            return;
        }
        let actual = &self.router_ids[..k];
        if self.first {
            self.report.unscored += 1;
        } else {
            let grade = |p: &[u16], s: &mut PredictorStats| {
                let pred = &p[..k.min(p.len())];
                let hits = actual.iter().filter(|e| pred.contains(e)).count() as u64;
                s.rows += 1;
                s.slots += k as u64;
                s.hit_slots += hits;
                s.exact_rows += u64::from(hits == k as u64);
            };
            let mut by = self.report.by_layer.get(l).copied().unwrap_or_default();
            if let Some(i) = self.slot(layer.moe, 0) {
                grade(&self.table[i].ids, &mut self.report.ctrl);
                grade(&self.table[i].ids, &mut by[2]);
            }
            if self.prev_ok.get(l) == Some(&true) {
                grade(&self.prev[l], &mut self.report.prev);
                grade(&self.prev[l], &mut by[1]);
            }
            match self.slot(layer.moe, 1) {
                Some(i) if l > 0 => {
                    grade(&self.table[i].ids, &mut self.report.stale);
                    grade(&self.table[i].ids, &mut by[0]);
                }
                _ => self.report.unscored += 1,
            }
            if let Some(i) = self.slot(layer.moe, 2).filter(|_| l > 1) {
                grade(&self.table[i].ids, &mut self.report.stale2);
            }
            if let Some(b) = self.report.by_layer.get_mut(l) {
                *b = by;
            }
        }
        if let (Some(prev), Some(ok)) = (self.prev.get_mut(l), self.prev_ok.get_mut(l)) {
            prev.clear();
            prev.extend_from_slice(&self.router_ids);
            *ok = true;
        }
    }

    /// After the hooks: build this layer's speculation plan (predicted experts of later layers
    /// to read or retain) and, when `trace` is asked for, the per-slot predictions for the
    /// route trace. `k` is the applied routing width.
    pub(crate) fn plan(&mut self, layer: LayerId, k: usize, trace: bool) {
        if !self.eligible || self.first {
            return;
        }
        let l = layer.moe as usize;
        let mut spec = std::mem::take(&mut self.spec);
        if self.cfg.prefetch {
            for h in 1..=2 {
                if let Some(p) = self.get((l + h) as u16, h).filter(|_| l + h < self.n_moe) {
                    spec.push(SpecTarget {
                        target: (l + h) as u16,
                        experts: drop_aware(p, k, self.cfg.drop_frac, self.cfg.gating),
                        cap: self.cfg.spec_max,
                        committed: false,
                    });
                }
            }
        }
        let n = self.cfg.route_ahead as usize;
        if n > 0 && l + n < self.n_moe {
            if let Some(p) = self.get((l + n) as u16, n) {
                spec.push(SpecTarget {
                    target: (l + n) as u16,
                    experts: drop_aware(p, k, self.cfg.drop_frac, self.cfg.gating),
                    cap: u32::MAX,
                    committed: true,
                });
            }
        }
        self.spec = spec;
        if trace {
            self.trace.clear();
            for slot in 0..k {
                let mut row = [None; PRED_HORIZON_MAX];
                for (h, cell) in row.iter_mut().enumerate() {
                    if let Some(p) = self.get(layer.moe, h + 1) {
                        *cell = p.ids.get(slot).map(|&e| (e, p.weights[slot]));
                    }
                }
                self.trace.push(row);
            }
        }
    }

    /// End of step: hand this step's probe results to its stats.
    pub(crate) fn end_step(&mut self, stats: &mut StepStats) {
        if self.cfg.log && self.eligible {
            stats.predict = Some(std::mem::take(&mut self.report));
        }
    }
}

/// The predicted experts worth reading, in rank order: the first `k` (the applied width), and
/// with a drop threshold `F` only those whose predicted weight — as the gating weighs those
/// `k` (`Gating::narrow`: renormalised over them for a normalising gating), as a share of
/// their mass (`Gating::share`, as the dropping hook reads it) — is at least `F / k`, the top
/// one always kept (what `--drop-cold-experts` would not drop).
pub(crate) fn drop_aware(p: &Prediction, k: usize, frac: f32, gating: Gating) -> Vec<u16> {
    let k = k.min(p.ids.len());
    let ids = &p.ids[..k];
    if frac <= 0.0 || k <= 1 {
        return ids.to_vec();
    }
    let sum: f32 = p.weights[..k].iter().sum();
    if sum.is_nan() || sum <= 0.0 {
        return ids.to_vec();
    }
    let mut w = p.weights[..k].to_vec();
    gating.narrow(&mut w, k);
    let mass: f32 = w.iter().sum();
    let threshold = frac / k as f32;
    ids.iter()
        .zip(&w)
        .enumerate()
        .filter(|&(j, (_, &w))| j == 0 || gating.share(w, mass) >= threshold)
        .map(|(_, (&e, _))| e)
        .collect()
}

/// Add one step's probe results into a run's.
pub fn accumulate(into: &mut PredictReport, from: &PredictReport) {
    fn add(a: &mut PredictorStats, b: &PredictorStats) {
        a.rows += b.rows;
        a.slots += b.slots;
        a.hit_slots += b.hit_slots;
        a.exact_rows += b.exact_rows;
    }
    add(&mut into.stale, &from.stale);
    add(&mut into.stale2, &from.stale2);
    add(&mut into.prev, &from.prev);
    add(&mut into.ctrl, &from.ctrl);
    into.unscored += from.unscored;
    if into.by_layer.len() < from.by_layer.len() {
        into.by_layer
            .resize(from.by_layer.len(), [PredictorStats::default(); 3]);
    }
    for (a, b) in into.by_layer.iter_mut().zip(&from.by_layer) {
        for i in 0..3 {
            add(&mut a[i], &b[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_aware_keeps_the_top_one_and_what_would_not_be_dropped() {
        const G: Gating = Gating::SOFTMAX_RENORM;
        let p = Prediction {
            ids: vec![7, 3, 9, 1],
            weights: vec![0.5, 0.3, 0.15, 0.05],
        };
        // No threshold: the applied width's prefix.
        assert_eq!(drop_aware(&p, 4, 0.0, G), vec![7, 3, 9, 1]);
        assert_eq!(drop_aware(&p, 2, 0.0, G), vec![7, 3]);
        // F = 0.5 at k = 4: threshold 0.125, so 0.05 goes.
        assert_eq!(drop_aware(&p, 4, 0.5, G), vec![7, 3, 9]);
        // At k = 2 the weights renormalise over the two (0.625, 0.375) vs 0.5 / 2.
        assert_eq!(drop_aware(&p, 2, 1.0, G), vec![7]);
        // The top one survives any threshold.
        let flat = Prediction {
            ids: vec![2, 4],
            weights: vec![0.01, 0.99],
        };
        assert_eq!(drop_aware(&flat, 2, 1.0, G), vec![2, 4]);
    }

    #[test]
    fn horizons_follow_the_armed_predictors() {
        let log = PredictConfig {
            log: true,
            ..Default::default()
        };
        assert!((0..=2).all(|h| log.wants(h)) && !log.wants(3));
        let pf = PredictConfig {
            prefetch: true,
            ..Default::default()
        };
        assert!(!pf.wants(0) && pf.wants(1) && pf.wants(2) && !pf.wants(3));
        let ra = PredictConfig {
            route_ahead: 3,
            ..Default::default()
        };
        assert!(!ra.wants(0) && !ra.wants(1) && ra.wants(3) && ra.speculates());
        assert!(!PredictConfig::default().predicts());
    }

    #[test]
    fn reports_accumulate_per_predictor_and_layer() {
        let step = PredictReport {
            stale: PredictorStats {
                rows: 1,
                slots: 4,
                hit_slots: 3,
                exact_rows: 0,
            },
            unscored: 2,
            by_layer: vec![[PredictorStats::default(); 3]; 2],
            ..Default::default()
        };
        let mut run = PredictReport::default();
        accumulate(&mut run, &step);
        accumulate(&mut run, &step);
        assert_eq!(run.stale.hit_slots, 6);
        assert_eq!(run.unscored, 4);
        assert_eq!(run.by_layer.len(), 2);
    }
}
