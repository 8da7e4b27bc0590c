//! `--expert-substitute L` (features.md §7): cache-aware re-ranking. The router's scores are
//! taken in the gating's ranking space (`Gating::rank_score`: the log of a softmax
//! probability — the logit up to a constant —, gpt-oss's raw logit, a sigmoid score plus its
//! selection bias), every resident expert's score is raised by `L × (max s − min s)`, and the
//! top-k is taken again. The chosen experts are weighted from the router's *original* scores
//! exactly as the router weighs a selection (`Gating::weights_for`), so a substituted expert
//! is weighted by what the router actually thought of it. A row whose selected set does not
//! change is left untouched, which is what makes a tiny `L` byte-identical to the unhooked
//! run. Decode only.

use super::{HookContext, HookCounts, RouterHook};
use crate::backend::Routing;
use crate::gating::Gating;
use crate::layout::ExpertKey;
use crate::records::Phase;
use crate::vocab::HookError;

/// The substitution hook and its running counts.
#[derive(Clone, Debug)]
pub struct Substitute {
    /// `L`: the residency margin as a fraction of the row's score range.
    pub lambda: f32,
    /// How the model's router weighs a selection.
    pub gating: Gating,
    counts: HookCounts,
    scores: Vec<f32>,
    order: Vec<u16>,
    weights: Vec<f32>,
}

impl Substitute {
    /// A hook with margin `lambda`; `lambda ≤ 0` makes it a no-op.
    pub fn new(lambda: f32, gating: Gating) -> Self {
        Substitute {
            lambda,
            gating,
            counts: HookCounts::default(),
            scores: Vec::new(),
            order: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// Re-rank every row of `routing` that carries probabilities, with `is_resident(expert)`
    /// telling residency. Rows without probabilities (a backend that did not supply them) and
    /// rows with a dropped slot are left alone. Counts accumulate until `take_counts`.
    pub fn rerank_rows(&mut self, routing: &mut Routing, is_resident: &dyn Fn(u16) -> bool) {
        let k = routing.k();
        if self.lambda.is_nan() || self.lambda <= 0.0 || k == 0 {
            return;
        }
        for r in 0..routing.n_rows() {
            if routing.dropped(r).iter().any(|&d| d) {
                continue;
            }
            let Some(probs) = routing.probs(r) else {
                continue;
            };
            if probs.len() <= k || probs.len() > usize::from(u16::MAX) + 1 {
                continue;
            }
            let g = self.gating;
            let bias = routing.selection_bias();
            self.scores.clear();
            self.scores.extend(probs.iter().enumerate().map(|(e, &p)| {
                g.rank_score(p, bias.and_then(|b| b.get(e).copied()).unwrap_or(0.0))
            }));
            let (lo, hi) = self
                .scores
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &s| {
                    (lo.min(s), hi.max(s))
                });
            let margin = self.lambda * (hi - lo);
            if !margin.is_finite() {
                continue;
            }
            for (e, s) in self.scores.iter_mut().enumerate() {
                if is_resident(e as u16) {
                    *s += margin;
                }
            }
            self.order.clear();
            self.order.extend(0..probs.len() as u16);
            let scores = &self.scores;
            // Highest adjusted score first; ties to the lower id, so the order is total.
            self.order.sort_by(|&a, &b| {
                scores[b as usize]
                    .total_cmp(&scores[a as usize])
                    .then(a.cmp(&b))
            });
            let chosen = &self.order[..k];
            self.counts.reranked += k as u64;
            let old = routing.ids(r);
            let moved = chosen.iter().filter(|e| !old.contains(e)).count() as u64;
            if moved == 0 {
                continue;
            }
            self.counts.substituted += moved;
            self.weights.resize(k, 0.0);
            g.weights_for(probs, chosen, &mut self.weights);
            routing.ids_mut(r).copy_from_slice(chosen);
            routing.weights_mut(r).copy_from_slice(&self.weights);
        }
    }
}

impl RouterHook for Substitute {
    fn name(&self) -> &'static str {
        "expert-substitute"
    }

    fn apply(&mut self, cx: &HookContext<'_>, routing: &mut Routing) -> Result<(), HookError> {
        if cx.phase != Phase::Decode {
            return Ok(());
        }
        let layer = cx.layer.moe;
        let cache = cx.cache;
        self.rerank_rows(routing, &|expert| {
            cache.contains(ExpertKey { layer, expert })
        });
        Ok(())
    }

    fn take_counts(&mut self) -> HookCounts {
        std::mem::take(&mut self.counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(probs: &[f32], k: usize) -> Routing {
        let mut idx: Vec<u16> = (0..probs.len() as u16).collect();
        idx.sort_by(|&a, &b| probs[b as usize].total_cmp(&probs[a as usize]));
        let ids = &idx[..k];
        let sum: f32 = ids.iter().map(|&e| probs[e as usize]).sum();
        let w: Vec<f32> = ids.iter().map(|&e| probs[e as usize] / sum).collect();
        let mut r = Routing::new();
        r.reset(probs.len() as u32, 1);
        r.push_row_with_probs(0, ids, &w, probs).unwrap();
        r
    }

    #[test]
    fn a_resident_runner_up_replaces_the_weakest_and_keeps_its_router_weight() {
        let probs = [0.5f32, 0.3, 0.15, 0.05];
        let mut r = routed(&probs, 2);
        let mut h = Substitute::new(0.5, Gating::SOFTMAX_RENORM);
        h.rerank_rows(&mut r, &|e| e == 2);
        let c = h.take_counts();
        assert_eq!((c.reranked, c.substituted), (2, 1));
        // Expert 2 (resident) now outranks 1; 0 stays (its score minus 2's exceeds nothing).
        let mut ids = r.ids(0).to_vec();
        ids.sort();
        assert_eq!(ids, [0, 2]);
        let w0 = r.weights(0)[r.ids(0).iter().position(|&e| e == 0).unwrap()];
        assert!((w0 - 0.5 / 0.65).abs() < 1e-6);
        assert_eq!(h.take_counts(), HookCounts::default());
    }

    #[test]
    fn a_tiny_margin_changes_nothing_and_substitutes_nothing() {
        let probs = [0.5f32, 0.3, 0.15, 0.05];
        let mut r = routed(&probs, 2);
        let before = (r.ids(0).to_vec(), r.weights(0).to_vec());
        let mut h = Substitute::new(1e-6, Gating::SOFTMAX_RENORM);
        h.rerank_rows(&mut r, &|e| e >= 2);
        assert_eq!((r.ids(0).to_vec(), r.weights(0).to_vec()), before);
        let c = h.take_counts();
        assert_eq!((c.reranked, c.substituted), (2, 0));
        // Nothing resident: nothing moves either.
        let mut h = Substitute::new(1.0, Gating::SOFTMAX_RENORM);
        h.rerank_rows(&mut r, &|_| false);
        assert_eq!(r.ids(0), &before.0[..]);
    }
}
