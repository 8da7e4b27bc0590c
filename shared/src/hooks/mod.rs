//! Cache-aware router hooks: `--expert-substitute` (re-rank toward resident experts) and
//! `--drop-cold-experts` (skip cold, low-weight experts), plus the one place that turns a
//! `RunConfig` into the ordered hook list, so the engine and the simulator install the same
//! hooks in the same order (top-k override, substitution, dropping: expert-dropping.md and
//! features.md §7 put substitution before the drop decision).
//!
//! The seam itself lives here too: the `RouterHook` trait, what a hook may look at
//! (`HookContext`) and what it counts (`HookCounts`), and the plain top-k override; the decode
//! step runs the hooks (`step` re-exports these names).

pub mod drop_cold;
pub mod follow;
pub mod route_ahead;
pub mod substitute;

pub use drop_cold::DropCold;
pub use substitute::Substitute;

use crate::backend::Routing;
use crate::cache::ExpertCache;
use crate::config::RunConfig;
use crate::gating::Gating;
use crate::layout::ExpertLayout;
use crate::records::Phase;
use crate::vocab::{HookError, LayerId};

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

/// The router hooks `cfg` asks for, in the order they must run, for a model whose router
/// selects `model_top_k` experts under `gating` (which weighs what the top-k override keeps
/// and what substitution chooses as the router would). Empty when no routing policy is armed.
pub fn router_hooks(cfg: &RunConfig, model_top_k: u32, gating: Gating) -> Vec<Box<dyn RouterHook>> {
    let mut hooks: Vec<Box<dyn RouterHook>> = Vec::new();
    let k = cfg.n_expert_used_override;
    if k > 0 && k < model_top_k {
        hooks.push(Box::new(TopKOverride {
            k: u16::try_from(k).unwrap_or(u16::MAX),
            gating,
        }));
    }
    if cfg.substitute_lambda > 0.0 {
        hooks.push(Box::new(Substitute::new(cfg.substitute_lambda, gating)));
    }
    if cfg.drop_cold_frac > 0.0 {
        hooks.push(Box::new(DropCold {
            frac: cfg.drop_cold_frac,
            renormalize: cfg.drop_renorm,
            in_prefill: cfg.drop_prefill,
            gating,
        }));
    }
    hooks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_come_in_spec_order_and_only_when_armed() {
        let mut cfg = RunConfig::default();
        assert!(router_hooks(&cfg, 8, Gating::default()).is_empty());
        cfg.n_expert_used_override = 4;
        cfg.substitute_lambda = 0.2;
        cfg.drop_cold_frac = 0.75;
        let names: Vec<&str> = router_hooks(&cfg, 8, Gating::default())
            .iter()
            .map(|h| h.name())
            .collect();
        assert_eq!(
            names,
            ["n-expert-used", "expert-substitute", "drop-cold-experts"]
        );
        // An override at or above the model's width is not installed.
        cfg.n_expert_used_override = 8;
        assert_eq!(router_hooks(&cfg, 8, Gating::default()).len(), 2);
    }
}
