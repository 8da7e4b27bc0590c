//! Cache-aware router hooks: `--expert-substitute` (re-rank toward resident experts) and
//! `--drop-cold-experts` (skip cold, low-weight experts), plus the one place that turns a
//! `RunConfig` into the ordered hook list, so the engine and the simulator install the same
//! hooks in the same order (top-k override, substitution, dropping: expert-dropping.md and
//! features.md §7 put substitution before the drop decision).

pub mod drop_cold;
pub mod route_ahead;
pub mod substitute;

pub use drop_cold::DropCold;
pub use substitute::Substitute;

use crate::config::RunConfig;
use crate::gating::Gating;
use crate::step::{RouterHook, TopKOverride};

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
